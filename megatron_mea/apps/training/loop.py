"""The pretraining loop of `mea-pretrain`, on Megatron-Core's own components.

GPTModel + DDP + Megatron optimizer + `OptimizerParamScheduler`; every step runs the pipeline
schedules' `forward_backward_func` (micro-batches, gradient accumulation, PP, interleaved virtual
pipeline stages with one model chunk each), then the optimizer.
"""

import logging
import math
import os
import signal
import time
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

from megatron_mea import data
from megatron_mea._optional import import_extra
from megatron_mea.apps.training import errors, processes, run_dir, setup
from megatron_mea.apps.training.arguments import PretrainArgs
from megatron_mea.apps.training.batches import MicroBatches
from megatron_mea.apps.training.monitor import (GpuTelemetry, TensorBoard, append_metrics,
                                                format_line)
from megatron_mea.apps.training.signals import ExitSignalHandler
from megatron_mea.apps.training.watchdog import Heartbeat, describe_timeout, is_timeout
from megatron_mea.checkpoint.errors import ModelMismatchError
from megatron_mea.checkpoint.torch_dist import saved_settings, training_state
from megatron_mea.compat import batch_on_this_cp_rank
from megatron_mea.config import MEATransformerConfig
from megatron_mea.cpu import cuda_device_to_cpu, require_cpu_patches
from megatron_mea.model.gpt import initialize
from megatron_mea.model.run_config import save_config

logger = logging.getLogger(__name__)


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    # Context parallelism: this rank's load-balanced chunks of the sequence (no-op at CP=1).
    batch = batch_on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_masked_mean_loss, batch["loss_mask"])


def _masked_mean_loss(loss_mask, per_token_loss):
    mask = loss_mask.float().view(-1)
    loss = torch.sum(per_token_loss.float().view(-1) * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}


def _mean_over_data_parallel(loss_dicts) -> float:
    """Average 'lm loss' over micro-batches and data- (and context-) parallel ranks, visible on
    every rank."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    value = torch.zeros(1, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and loss_dicts:
        value += torch.stack([d["lm loss"] for d in loss_dicts]).mean()
        value /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        dist.all_reduce(
            value, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    # Only the last stage holds losses; a sum over the pipeline shares its value.
    dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return value.item()


class Trainer:
    """One pretraining run: build, (resume,) train, evaluate, checkpoint.

    Args:
        args: the run's validated arguments (not written to: `self.args` is
            `self.settings.args`, a copy with the vocabulary resolved).
        config: the run's config, as validation built it (`parse_run`).
        signals: the run's signal handler, installed by the caller before set-up
            (`pretrain`). Default: one of its own (`--exit-signal-handler`), installed by
            `train`.
    """

    def __init__(self, args: PretrainArgs, config: MEATransformerConfig,
                 signals: Optional[ExitSignalHandler] = None):
        require_cpu_patches("Trainer")
        self.signals = signals or ExitSignalHandler(enabled=args.exit_signal_handler)
        # Before any process: every value the run derives from its arguments, once (the
        # vocabulary resolved in a copy of them: the parsed arguments are not written to).
        self.settings = setup.run_settings(args, config)
        self.args = args = self.settings.args
        self.heartbeat, self.save_lock, self.run_log = None, None, None
        # What failed on this rank in the step just done (the ranks agree on it after the step).
        self.failure = None
        # The newest checkpoint of this run, loaded or saved: (directory, iteration).
        self.last_checkpoint = None
        self.iteration = 0
        # The set-up stage in flight, named by a timeout's or a signal's line (None: training).
        self.stage = "starting the process group"
        try:
            initialize(args, timeout_minutes=args.distributed_timeout_minutes)
            if dist.get_world_size() > 1:  # names a peer that stops answering
                self.heartbeat = Heartbeat(args.distributed_timeout_minutes).start()
            self._next_stage("claiming the run directories")
            # Before anything is built: one writer per --save, no silent fresh start over a run.
            self.save_lock, loads = setup.claim_run_directories(args)
            # Only now: a run refused above leaves no log file in a directory not its own.
            if args.save and dist.get_rank() == 0:
                self.run_log = run_dir.attach_run_log(args.save)
            self._set_up(args, loads)
            self._next_stage(None)
        except BaseException as exc:
            # Named before the heartbeat stops (it tells who stopped answering).
            ours = isinstance(exc, errors.ONE_LINE)
            timeout = self._timed_out() if is_timeout(exc) and not ours else None
            self.close()
            if timeout is not None:
                raise timeout from None
            raise

    def _next_stage(self, stage: Optional[str]) -> None:
        """End the set-up stage in flight and begin `stage` (None: training); first stop, on
        every rank, if any rank got a signal during the stage that ends. A collective."""
        if self.signals.enabled:
            signum, _ = self.signals.agreed_stop()
            if signum:
                raise errors.TrainingInterrupted(signum, (
                    f"interrupted by {signal.Signals(signum).name} during set-up "
                    f"({self.stage}): nothing trained yet, so nothing saved; "
                    f"{self._last_checkpoint_text()}"))
        self.stage = stage

    def _timed_out(self) -> errors.CollectiveTimeout:
        """The error that ends a run whose collective timed out (during set-up or a step)."""
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        where = (f"iteration {self.iteration + 1}" if self.stage is None
                 else f"set-up ({self.stage})")
        return errors.CollectiveTimeout(
            f"rank {rank}, {where}: "
            f"{describe_timeout(self.heartbeat, self.args.distributed_timeout_minutes)}; "
            f"{self._last_checkpoint_text()}"
        )

    def _set_up(self, args: PretrainArgs, loads: bool) -> None:
        """Build the model, optimizer and data; load the checkpoint if `loads`."""
        settings = self.settings
        # Data tokenized for a larger vocabulary: named before the model is built (the
        # embedding would fail at the first batch holding such an id). The files as checked
        # are the files watched: one changed later is named before a micro-batch reads it.
        self.data_watch = None
        if settings.data_prefixes:
            from megatron_mea.data.checks import check_token_ids
            from megatron_mea.data.identity import DataWatch

            self._next_stage("checking the data files")
            for prefix in settings.data_prefixes:
                check_token_ids(prefix, args.vocab_size, settings.datasets.cache_dir)
            self.data_watch = DataWatch(settings.data_prefixes)
        self.rank = dist.get_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * self.dp_size)
        self.config = settings.config
        self._next_stage("building the model and optimizer")
        self.model, self.optimizer, self.scheduler = setup.setup_model_and_optimizer(args, settings)
        consumed = 0
        if loads:
            self._next_stage(f"loading the checkpoint in {args.load}")
            try:
                self.iteration, consumed = training_state.load_checkpoint(
                    args.load, self.modules, self.optimizer, self.scheduler,
                    load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                    use_distributed_optimizer=args.use_distributed_optimizer,
                    iteration=args.ckpt_step, data_settings=settings.checkpoint_settings,
                    override_data_settings=args.override_checkpoint_data_settings,
                )
            except ModelMismatchError as exc:
                # A tensor's name or shape says little about which flag is off; the saving
                # run's config.yaml names the setting.
                raise saved_settings.explain_model_mismatch(args.load, args, exc) from None
            self.last_checkpoint = (args.load, self.iteration)
        self._next_stage("building the datasets' indices")
        if args.save and self.rank == 0:
            save_config(args, args.save)
        self.train_data, valid, _ = data.build_gpt_datasets_rank_zero_first(
            settings.datasets, settings.tokenizer)
        self.valid_data = None if args.eval_iters == 0 else valid
        self.train_batches = self._batches(self.train_data, consumed)
        self.valid_consumed = 0
        self.nan_streak = 0
        self.forward_backward_func = get_forward_backward_func()
        self.telemetry = GpuTelemetry()
        self.tensorboard = TensorBoard(args.tensorboard_dir if self.rank == 0 else None)
        self.moe_track_names = settings.moe_track_names

    def close(self) -> None:
        """Stop the heartbeat, close the run's log file, release the lock on --save (the end
        of the run)."""
        if self.run_log is not None:
            run_dir.detach_run_log(self.run_log)
            self.run_log = None
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None

    @property
    def modules(self) -> list:
        """The model chunks without their DDP wrappers."""
        return [chunk.module for chunk in self.model]

    def _batches(self, dataset, consumed):
        """This rank's micro-batches; with virtual pipeline stages one iterator per chunk (the
        interleaved schedule reads each chunk's own), all at the same position."""
        make = partial(
            MicroBatches, dataset, self.args.micro_batch_size,
            parallel_state.get_data_parallel_rank(), self.dp_size, consumed,
            before_read=self.data_watch.check_often if self.data_watch is not None else None,
        )
        if len(self.model) == 1:
            return make()
        return [make() for _ in self.model]

    @property
    def consumed_samples(self) -> int:
        """Global training samples consumed so far."""
        batches = self.train_batches
        return (batches[0] if isinstance(batches, list) else batches).consumed_samples

    # ---- one step ----------------------------------------------------------------------------

    def forward_backward(self, batches=None, forward_only=False) -> float:
        """Zero the gradients and run one step's micro-batches through Megatron's schedule
        (forward and backward, gradients reduced and finalized; no update); returns the loss,
        averaged over micro-batches and data-parallel ranks."""
        args = self.args
        if not forward_only:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        # The schedules allocate small scratch tensors on "cuda" (a no-op context on GPUs; see
        # megatron_mea.cpu).
        with cuda_device_to_cpu():
            try:
                loss_dicts = self.forward_backward_func(
                    forward_step_func=_forward_step,
                    data_iterator=self.train_batches if batches is None else batches,
                    model=self.model,
                    num_microbatches=self.num_microbatches,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    forward_only=forward_only,
                )
            except Exception as exc:
                # Data changed under the run (checked before each micro-batch; a read that
                # failed mid-batch is checked here): one line naming the file, not the
                # IndexError it causes.
                changed = self._data_changed(exc)
                if changed is None:
                    raise
                raise errors.RunFailure(f"iteration {self.iteration + 1}: {changed}; "
                                        f"{self._last_checkpoint_text()}") from None
            return _mean_over_data_parallel(loss_dicts)

    def train_step(self) -> dict:
        """One optimizer step over `num_microbatches` micro-batches; returns its scalars."""
        args = self.args
        loss = self.forward_backward()
        with cuda_device_to_cpu():
            # Checked before the update: Megatron's fp32/bf16 step would apply NaN gradients.
            # The norm is computed once more inside step(); the price of never corrupting weights.
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            finite = math.isfinite(loss) and math.isfinite(grad_norm)
            update_ok = finite and self.optimizer.step()[0]
        if finite:
            self.scheduler.step(increment=1)
            self.nan_streak = 0
        else:
            self._non_finite(loss, grad_norm)
        scalars = {
            "lm loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad norm": grad_norm,
            "skipped": int(not update_ok),
        }
        if self.moe_track_names:
            moe = {}
            with cuda_device_to_cpu():
                track_moe_metrics(
                    loss_scale=1.0 / self.num_microbatches,
                    iteration=self.iteration,
                    total_loss_dict=moe,
                    force_initialize=True,
                    track_names=self.moe_track_names,
                    num_layers=args.num_layers,
                    moe_layer_freq=args.moe_layer_freq,
                )
            scalars.update({name: float(value) for name, value in moe.items()})
        return scalars

    def _data_changed(self, exc: Exception):
        """The line naming a data file changed under the run, if `exc` came from one (None:
        the data files are as loaded)."""
        from megatron_mea.data.identity import DataChanged

        if isinstance(exc, DataChanged):
            return str(exc)
        if self.data_watch is None:
            return None
        try:
            self.data_watch.check()
        except DataChanged as changed:
            return str(changed)
        return None

    def _non_finite(self, loss: float, grad_norm: float) -> None:
        """Apply `nan_policy` to a step whose loss or grad norm is NaN/Inf (all ranks agree:
        both values are reduced over the whole model)."""
        args, step = self.args, self.iteration + 1
        self.nan_streak += 1
        logger.warning(
            "rank %d: iteration %d has a non-finite lm loss (%s) or grad norm (%s); policy %s",
            self.rank, step, loss, grad_norm, args.nan_policy,
        )
        if args.nan_policy == "stop":
            raise errors.TrainingStopped(
                f"iteration {step}: non-finite lm loss ({loss}) or grad norm ({grad_norm}); "
                f"stopped with nan_policy=stop; {self._last_good_checkpoint_text()}"
            )
        if self.nan_streak >= args.nan_max_consecutive_skips:
            raise errors.TrainingStopped(
                f"iteration {step}: {self.nan_streak} non-finite steps in a row (from iteration "
                f"{step - self.nan_streak + 1}; nan_max_consecutive_skips="
                f"{args.nan_max_consecutive_skips}); stopped, no checkpoint saved inside the "
                f"streak; {self._last_good_checkpoint_text()}"
            )

    def evaluate(self) -> float:
        """Mean validation loss over `eval_iters` (>= 1) global batches (no gradients)."""
        batches = self._batches(self.valid_data, self.valid_consumed)
        losses = []
        for _ in range(self.args.eval_iters):
            with torch.no_grad():
                losses.append(self.forward_backward(batches, forward_only=True))
        first = batches[0] if isinstance(batches, list) else batches
        self.valid_consumed = first.consumed_samples
        return sum(losses) / len(losses)

    # ---- the run -----------------------------------------------------------------------------

    def train(self) -> list:
        """Train to `train_iters` (or `exit_interval` more steps); returns the per-step history."""
        args = self.args
        history, started_at = [], self.iteration
        progress = None
        if self.rank == 0 and not args.no_progress_bar:
            tqdm = import_extra("tqdm", "the progress bar (--no-progress-bar turns it off)").tqdm
            progress = tqdm(total=args.train_iters, initial=self.iteration, unit="step",
                            dynamic_ncols=True, desc=args.attention_variant)
        metrics_path = os.path.join(args.save, "metrics.jsonl") if args.save else None
        signals = self.signals
        signals.plan = ("saving a checkpoint at the end of this step" if args.save else
                        "stopping at the end of this step (no --save, so no checkpoint)")
        try:
            with signals:
                self._train_loop(history, started_at, progress, metrics_path, signals)
        except Exception as exc:
            if isinstance(exc, errors.ONE_LINE) or not is_timeout(exc):
                raise
            raise self._timed_out() from None
        finally:
            if progress is not None:
                progress.close()
            self.tensorboard.close()
        return history

    def _train_loop(self, history, started_at, progress, metrics_path, signals) -> None:
        args = self.args
        tokens_per_step = args.global_batch_size * args.seq_length
        window_start = time.perf_counter()
        while self.iteration < args.train_iters:
            scalars = self.train_step()
            self.iteration += 1
            elapsed = time.perf_counter() - window_start
            window_start = time.perf_counter()
            scalars["tokens/s"] = tokens_per_step / elapsed
            scalars.update(self.telemetry.read())
            due = self.iteration % args.eval_interval == 0 or self.iteration == args.train_iters
            # No validation split, or --eval-iters 0: nothing to evaluate.
            if due and self.valid_data is not None and args.eval_iters > 0:
                scalars["valid loss"] = self.evaluate()
                window_start = time.perf_counter()
            record = {"iteration": self.iteration, **scalars}
            history.append(record)
            if self.rank == 0:
                self._report(record, progress, metrics_path)
            # Every rank learns of a signal any rank got, so all save together, and of a
            # failure on any rank, so all stop.
            signum, failed_rank = signals.agreed_stop(self.failure is not None)
            if failed_rank is not None:
                cause = self.failure or f"rank {failed_rank} failed (its own line says why)"
                raise errors.RunFailure(f"iteration {self.iteration}: {cause}; "
                                        f"{self._last_checkpoint_text()}")
            done = self.iteration >= args.train_iters
            stop = args.exit_interval and self.iteration - started_at >= args.exit_interval
            saved = False
            if args.save and (
                done or stop or signum
                or (args.save_interval and self.iteration % args.save_interval == 0)
            ):
                # Inside a non-finite streak the weights may be what diverges: a checkpoint
                # there would become `latest`, and resuming would re-enter the streak.
                if self.nan_streak:
                    logger.warning("iteration %d: not saved, inside a streak of %d non-finite "
                                   "steps; %s", self.iteration, self.nan_streak,
                                   self._last_checkpoint_text())
                else:
                    self.save(args.save)
                    saved = True
            if signum and not done:
                raise errors.TrainingInterrupted(signum, self._interrupted(signum, saved))
            if stop:
                break

    def _interrupted(self, signum: int, saved: bool) -> str:
        """The line that ends a run stopped by `signum` (`saved`: a checkpoint was written)."""
        return errors.interrupted(signum, self.iteration, self.args.save, saved,
                                  self.nan_streak, self._last_good_checkpoint_text())

    def _last_checkpoint_text(self) -> str:
        return errors.last_checkpoint_text(self.last_checkpoint, self.args.load)

    def _last_good_checkpoint_text(self) -> str:
        """Where to resume from after a non-finite streak (no checkpoint is saved inside one)."""
        return errors.last_good_checkpoint_text(self.last_checkpoint)

    def save(self, root: str) -> None:
        """Checkpoint the run's current state under `root` (all ranks call it)."""
        # Megatron's writer starts helper processes: they must not outlive a killed run.
        processes.children_die_with_parent()
        try:
            training_state.save_checkpoint(
                root, self.iteration, self.modules, self.optimizer, self.scheduler,
                self.consumed_samples,
                use_distributed_optimizer=self.args.use_distributed_optimizer,
                fully_reshardable=self.args.dist_ckpt_optim_fully_reshardable,
                data_settings=self.settings.checkpoint_settings,
                megatron_lm_args=self.settings.megatron_lm_args,
            )
        except training_state.SaveFailed as exc:
            raise errors.RunFailure(f"iteration {self.iteration}: {exc}; "
                                    f"{self._last_checkpoint_text()}") from None
        self.last_checkpoint = (root, self.iteration)

    def _report(self, record, progress, metrics_path):
        args = self.args
        scalars = {k: v for k, v in record.items() if k != "iteration"}
        self.tensorboard.add(scalars, record["iteration"])
        if metrics_path:
            # A failed write stops the run after the step (every rank agrees on it).
            self.failure = append_metrics(metrics_path, record) or self.failure
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{record['lm loss']:.3f}")
        if record["iteration"] % args.log_interval == 0 or "valid loss" in record:
            line = format_line(record["iteration"], args.train_iters, scalars)
            (progress.write if progress is not None else logger.info)(line)


def pretrain(args: PretrainArgs, config: MEATransformerConfig) -> list:
    """Run a whole pretraining job; returns the history of this process's steps.

    Args:
        args: the run's validated arguments.
        config: the run's config, as validation built it (`parse_run`).
    """
    # Installed before set-up, as Megatron-LM's is: a signal while the checkpoint loads or the
    # indices build stops the run in one line, its lock released.
    with ExitSignalHandler(enabled=args.exit_signal_handler) as signals:
        try:
            trainer = Trainer(args, config, signals)
            try:
                return trainer.train()
            finally:
                trainer.close()
        finally:
            parallel_state.destroy_model_parallel()

