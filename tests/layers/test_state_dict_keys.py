"""Checkpoint keys stay as checkpoints hold them: every variant's `state_dict` and
`sharded_state_dict` (keys, shapes, order, checkpoint keys, offsets, replica ids) equal those
recorded from main before the layers' pieces became `Submodules` fields (issue 35)."""

import json

import pytest

from tests.layers._state_dict_keys import (
    DATA,
    build_case,
    case_names,
    fingerprint,
    listing,
    release_series,
)


def _recorded() -> dict:
    series = json.loads(DATA.read_text()).get(release_series())
    if series is None:
        pytest.fail(f"no keys recorded for megatron-core {release_series()}: run "
                    "`python -m tests.layers._state_dict_keys` on a commit whose keys are known")
    return series


@pytest.mark.parametrize("case", case_names())
def test_checkpoint_keys_equal_those_recorded_before_the_submodules(single_rank, case):
    lines = listing(build_case(case))
    assert fingerprint(lines) == _recorded()[case], (
        f"{case}: the keys differ from those recorded; this build's listing:\n"
        + "\n".join(lines)
        + "\n(print the recorded commit's with `python -m tests.layers._state_dict_keys "
        f"{case}` there and diff)"
    )


def test_every_recorded_case_is_checked():
    assert sorted(_recorded()) == sorted(case_names())
