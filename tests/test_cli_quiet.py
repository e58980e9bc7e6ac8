"""The command-line tools' warning filters drop the notices a user cannot act on, and only them."""

import warnings

from megatron_mea.quiet import quiet_warnings


def test_the_tools_drop_torchs_sharded_tensor_notice_and_keep_others():
    # torch's own message: if torch rewords it, this fails and the filter needs the new words.
    from torch.distributed._shard._utils import DEPRECATE_MSG

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()
        warnings.warn(DEPRECATE_MSG, FutureWarning)
        warnings.warn("a notice the user can act on", FutureWarning)
    assert [str(w.message) for w in caught] == ["a notice the user can act on"]
