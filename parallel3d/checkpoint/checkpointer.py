"""The trainer's view of checkpoints: load at start, save every ``checkpoint.interval``.

The trainer calls, in order::

    ckpt = Checkpointer(cfg, topo, model_cfg)
    ckpt.load_weights(model)           # from the checkpoint being resumed, else from
                                       # model.hf_checkpoint, else nothing (seeded init)
    ... build the optimizer and the sampler ...
    step = ckpt.load_training_state(trainer)   # optimizer, sampler, RNG; the step to resume at
    ... each step: ckpt.maybe_save(trainer) ...
    ckpt.finish(trainer)               # wait for a background save, export to Hugging Face

It reads the trainer's ``model``, ``optimizer``, ``sampler``, ``step``, ``topo`` and
``cfg`` and never asks which parallelism is on: the placements and optimizer adapters
describe every rank's state in the same terms.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.errors import UserError

from .format import check_same_model, model_identity
from .optim_state import load_optimizer, optimizer_slots, sharded_model_slots
from .reader import CheckpointReader, find_checkpoint
from .sampler_state import foreign_sampler_state, load_sampler_state, sampler_state_at
from .save import CheckpointWriter, RankPayload, patient, snapshot
from .state import Slot, param_placements, read_block, rng_state, set_rng_state


# How long a rank waits for the others to finish loading (not comm_timeout_s: reading and
# verifying a large checkpoint is not a collective that may hang, and takes minutes).
LOAD_WAIT_S = 3600.0


def _layout(cfg, topo) -> dict:
    return {"tp": topo.tp, "cp": topo.cp, "pp": topo.pp, "dp": topo.dp, "ep": topo.ep, "world_size": topo.world_size,
            "zero": getattr(cfg.parallel, "zero", 0)}


def check_checkpoint_options(c) -> None:
    """What the checkpoint section must hold before the run builds anything (the dry run
    checks it too): sizes >= 0, and a ``resume`` path that is a folder."""
    if c.interval < 0 or c.keep < 0:
        raise UserError(f"checkpoint.interval ({c.interval}) and checkpoint.keep ({c.keep}) "
                        "must be >= 0 (0: never save / keep all)")
    if c.resume not in ("never", "auto") and not Path(c.resume).is_dir():
        raise UserError(f"checkpoint.resume '{c.resume}' is not a folder: give a checkpoint folder, "
                        "a checkpoints folder with 'latest', 'auto' or 'never'")


def _adapters_in(source, placements: list) -> bool:
    """Whether ``source`` holds the LoRA adapters of ``placements`` (all of them, in this
    run's shapes: a LoRA run's checkpoint) or none (a base model); else a UserError."""
    held = [pl for pl in placements if source.has("model/" + pl.name)]
    if held and len(held) < len(placements):
        missing = next(pl.name for pl in placements if pl not in held)
        raise UserError(f"{source.folder} holds LoRA adapters but not {missing}: resume with the "
                        "lora.targets it was trained with")
    for pl in held:
        shape = tuple(source.spec("model/" + pl.name)[0])
        if shape != pl.shape:
            raise UserError(f"{source.folder}: the adapter {pl.name} has shape {shape}, this run's is "
                            f"{pl.shape}: resume with the lora.rank it was trained with")
    return bool(held)


class Checkpointer:
    def __init__(self, cfg, topo, model_cfg):
        self.job, self.cfg, self.topo, self.model_cfg = cfg, cfg.checkpoint, topo, model_cfg
        c = self.cfg
        check_checkpoint_options(c)
        run_dir = Path(cfg.run.dir)
        self.root = Path(c.dir) if c.dir else run_dir / "checkpoints"
        self.export_dir = (run_dir / c.export_hf) if c.export_hf else None
        self.group = None
        if dist.is_initialized() and topo.world_size > 1:
            # Its own gloo group: a background save gathers on it while training
            # communicates on the others (and CPU objects need gloo under nccl too).
            # Bound by the job's timeout like every other group (torch's default for a new
            # group is 30 minutes: a peer lost during a save hung the others that long);
            # the waits that are not communication carry limits of their own (the write
            # phase: save.write_wait_s; the load: LOAD_WAIT_S).
            timeout = timedelta(seconds=topo.timeout_s) if topo.timeout_s else None
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.writer = CheckpointWriter(self.root, topo.rank, topo.world_size, self.group,
                                       keep=c.keep, token=self._agree(secrets.token_hex(4)),
                                       async_save=c.async_save,
                                       comm_timeout_s=cfg.reliability.comm_timeout_s,
                                       group_timeout_s=topo.timeout_s)
        self.reader: CheckpointReader | None = None
        self.resumed_from: Path | None = None
        self.hf_config: dict | None = None  # carried into checkpoints, for the export
        self.adapters_loaded = False  # LoRA's adapters came from the source (a LoRA run's checkpoint)
        self._last_saved = -1

    def _agree(self, value):
        """Rank 0's ``value``, on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # -- loading ---------------------------------------------------------------------------
    def wait_for_every_rank(self) -> None:
        """Return when every rank has loaded (weights and training state, or initialised).

        Ranks load at different speeds (each verifies and reads its own files), and the
        first collective of training is bound by ``reliability.comm_timeout_s``: without
        this, a rank that loaded faster waits for the slowest inside that collective and
        fails (gloo), or its watchdog, armed by the first step, counts the wait (NCCL).
        The barrier runs on the checkpointer's own gloo group with a limit of its own,
        :data:`LOAD_WAIT_S` (the group's timeout raised for it: a ``monitored_barrier``'s own
        limit does not cover its peers' sends, so a slow rank 0 failed it)."""
        if self.group is None:
            return
        with patient(self.group, LOAD_WAIT_S, self.topo.timeout_s):
            dist.barrier(group=self.group)

    def _resume_source(self):
        """The checkpoint to resume as a source: a parallel3d checkpoint, or another
        framework's (DeepSpeed ZeRO 0-3, torch DCP, Megatron) named by ``checkpoint.resume``."""
        how = self.cfg.resume
        if how == "never":
            return None
        if how == "auto":
            found = find_checkpoint(self.root)
            return CheckpointReader(found, verify=self.cfg.verify) if found is not None else None
        path = Path(how)
        from .convert import open_source
        from .foreign.hf import HFFolder

        try:
            source = open_source(path, verify=self.cfg.verify)
        except UserError as e:
            if find_checkpoint(path) is None and "is neither" in str(e):
                raise UserError(f"checkpoint.resume '{how}' holds no complete checkpoint") from None
            raise
        if isinstance(source, HFFolder):
            source.close()
            raise UserError(f"checkpoint.resume '{how}' is a Hugging Face model folder: start from "
                            "it with model.hf_checkpoint (resume is for training checkpoints)")
        return source

    @property
    def foreign(self) -> bool:
        """Whether the checkpoint resumed was written by another framework."""
        return self.reader is not None and not isinstance(self.reader, CheckpointReader)

    def _source_to_resume(self):
        """:meth:`_resume_source`, opened once."""
        if not hasattr(self, "_to_resume"):
            self._to_resume = self._resume_source()
        return self._to_resume

    def _placements(self, model) -> dict:
        """What this rank holds of each logical tensor, and whether it writes it (dense
        weights: one writer among dp x cp; experts: among edp x cp)."""
        er = self.topo.expert_replicas()
        return param_placements(model, self.model_cfg, self.topo.dp_cp_rank, self.topo.dp_cp,
                                expert_replicas=(er.rank, er.size))

    def has_weights_to_load(self) -> bool:
        """Whether :meth:`load_weights` will fill every parameter (a checkpoint to resume,
        or ``model.hf_checkpoint``): the model then needs no initialisation of its own."""
        return self._source_to_resume() is not None or bool(self.job.model.hf_checkpoint)

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module, fill=None) -> str | None:
        """Fill ``model``'s parameters from the checkpoint to resume, or from
        ``model.hf_checkpoint``; returns where they came from (None: seeded init kept).
        ``fill(load)``: calls ``load(params)`` for groups of parameters (ZeRO 3: one bucket
        at a time, :meth:`ZeroOptimizer.fill_params`) or once with None (all of them)."""
        found = self._source_to_resume()  # every rank alike: nothing writes before training starts
        placements = self._placements(model)
        if found is not None:
            self.reader = found
            if isinstance(found, CheckpointReader):  # each file hashed once in the world, agreed
                with patient(self.group, LOAD_WAIT_S, self.topo.timeout_s):  # hashing is not a hang
                    found.verify_shared(self.topo.rank, self.topo.world_size, self.group)
            saved = found.index.model if isinstance(found, CheckpointReader) else model_identity(found.model_config)
            check_same_model(saved, model_identity(self.model_cfg), found.folder)
            from .foreign.peft import with_lora_base

            source = with_lora_base(found)  # LoRA: the frozen weights from the base the checkpoint names
            self.resumed_from = Path(found.folder)
        elif self.job.model.hf_checkpoint:
            from .foreign.hf import HFFolder

            source = HFFolder(self.job.model.hf_checkpoint)
            check_same_model(model_identity(source.model_config), model_identity(self.model_cfg),
                             source.folder)
        else:
            return None
        adapters = [p for p in model.parameters() if getattr(p, "p3d_lora", False)]
        self.adapters_loaded = _adapters_in(source, [placements[id(p)] for p in adapters])

        def load(params) -> None:  # None: every parameter
            for p in (model.parameters() if params is None else params):
                pl = placements[id(p)]
                if getattr(p, "p3d_lora", False) and not self.adapters_loaded:
                    continue  # a base model: the adapters start on their own (start_adapters_)
                name = "model/" + pl.name
                if p.dtype == torch.float32 and source.has("master/" + pl.name):
                    name = "master/" + pl.name  # fp32 masters of a bf16 run: full precision
                read_block(source, name, pl, p.dtype, p.device, out=p)  # this rank's slice, in place

        (fill or (lambda fn: fn(None)))(load)
        self.hf_config = source.hf_config
        if source is not found and found is not None:
            source.base.close()  # the LoRA base's files; the checkpoint stays open for the training state
        return str(source.folder)

    def load_training_state(self, trainer) -> int:
        """Optimizer, sampler and RNG from the checkpoint being resumed; returns its step
        (0 without one). Call after :meth:`load_weights` and building the optimizer.

        From another framework's checkpoint: the Adam moments and step (any layout, zero 0
        or the sharded optimizer), and the data position of a parallel3d run at that step
        (the sampler continues at ``step * global_batch``); the RNG is not carried."""
        if self.reader is None:
            return 0
        trainer_state = self.reader.trainer or {}
        placements = self._placements(trainer.model)
        had_optimizer = load_optimizer(trainer.optimizer, placements, trainer_state.get("optimizer"),
                                       self.reader)
        step = int(trainer_state.get("step", self.reader.step))
        saved = foreign_sampler_state(trainer, step) if self.foreign else trainer_state.get("sampler")
        load_sampler_state(trainer, saved, step, self.reader.folder)
        if not self.foreign:
            index = self.reader.index
            same_layout = all(index.layout.get(k) == v for k, v in _layout(self.job, self.topo).items())
            meta = self.reader.rank_meta(self.topo.rank if same_layout else 0)
            if meta and "rng" in meta:
                set_rng_state(meta["rng"])
        if self.topo.rank == 0:
            note = "" if had_optimizer else " (weights only: the optimizer starts fresh)"
            if had_optimizer and self.foreign:
                note = self._foreign_note(trainer_state.get("optimizer") or {})
            print(f"resuming from {self.reader.folder} at step {step}{note}", flush=True)
        self._last_saved = step
        return step

    def _foreign_note(self, opt: dict) -> str:
        """What came across, and the source's hyper-parameters where they differ from ours."""
        t = self.job.train
        ours = {"lr": None, "betas": [t.beta1, t.beta2], "eps": t.eps}
        differ = [f"{k} {opt[k]} there, {v} here" for k, v in ours.items()
                  if v is not None and k in opt and opt[k] != v]
        lr = f"; its last lr {opt['lr']:g}" if isinstance(opt.get("lr"), (int, float)) else ""
        warn = f"; differing: {', '.join(differ)}" if differ else ""
        return f" (Adam moments and step {opt.get('step')} from it{lr}{warn})"

    # -- saving ----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether this run writes checkpoints at all."""
        return self.cfg.interval > 0 or self.export_dir is not None

    def save_now(self, trainer) -> None:
        """The trainer's hook before it stops on a non-finite step: save the last good
        step and wait until it is on disk.

        The stopped step (``trainer.step``) changed no weight and no optimizer state, but
        its batch was consumed; the checkpoint is that of step ``trainer.step - 1`` with the
        data position before that batch, so a resume repeats the stopped step exactly as
        a resume from a regular checkpoint of the last good step would."""
        good = trainer.step - 1
        if good != self._last_saved:
            self.save(trainer, step=good)
        self.writer.wait()

    def due(self, trainer) -> bool:
        """Whether :meth:`maybe_save` saves at ``trainer.step`` (the same on every rank)."""
        every, last = self.cfg.interval, trainer.cfg.train.steps
        due = every > 0 and (trainer.step % every == 0 or trainer.step == last)
        return due and trainer.step != self._last_saved

    def maybe_save(self, trainer) -> bool:
        if not self.due(trainer):
            return False
        self.save(trainer)
        return True

    def save(self, trainer, step: int | None = None) -> None:
        """Save the trainer's state as the checkpoint of ``step`` (default ``trainer.step``;
        :meth:`save_now` gives the step before a stopped one); collective over all ranks."""
        step = trainer.step if step is None else step
        self.writer.wait()  # the previous background save, before state is copied again
        placements = self._placements(trainer.model)
        # LoRA on a Hugging Face base: what trains, and the base by reference (the job's
        # model.hf_checkpoint, in the saved config); the frozen weights stay in the base
        frozen_by_reference = bool(self.job.lora.rank and self.job.model.hf_checkpoint)
        # ZeRO 3: each dp rank writes its own shard of the weights (no bucket gathered)
        slots = sharded_model_slots(trainer.optimizer, placements, with_frozen=not frozen_by_reference)
        if slots is not None:
            slots = [s for s in slots if s.placement.owner]
        else:
            wait = getattr(trainer.optimizer, "wait_for_params", None)
            if wait is not None:
                wait()  # a sharded optimizer may still be gathering the updated parameters
            slots = [Slot("model/" + placements[id(p)].name, placements[id(p)], p)
                     for p in trainer.model.parameters()
                     if placements[id(p)].writer and (p.requires_grad or not frozen_by_reference)]
        opt_scalars, opt_slots = optimizer_slots(trainer.optimizer, placements)
        # whole blocks are equal over dp (one writer); flat shards of a sharded optimizer
        # differ over dp (each dp rank writes its own) and are equal over model-parallel
        # replicas (the owner); stage 0's flat state is equal over dp too (one writer)
        sharded = getattr(trainer.optimizer, "shards_over_dp", False)
        slots += [s for s in opt_slots
                  if (s.placement.owner if s.flat is not None and sharded else s.placement.writer)]
        meta = {"rank": self.topo.rank, **self.topo.coords(), "rng": rng_state()}
        fields = {}
        if self.topo.rank == 0:
            fields = {"model": model_identity(self.model_cfg), "config": self.job.to_dict(),
                      "layout": _layout(self.job, self.topo),
                      "trainer": {"step": step, "optimizer": opt_scalars,
                                  "sampler": sampler_state_at(trainer, step)}}
            if self.hf_config:
                fields["hf_config"] = self.hf_config
        # async: the writer's thread copies the tensors, and the optimizer's next update
        # waits for that copy (the training thread only lists them)
        gates = getattr(trainer.optimizer, "before_update", None)
        background = self.cfg.async_save and gates is not None
        if background and self.writer.wait_copied not in gates:
            gates.append(self.writer.wait_copied)
        payload = RankPayload(step, self.topo.rank, snapshot(slots, copy=self.cfg.async_save) if not background
                              else [Slot(s.name, s.placement, s.tensor.detach(), s.flat) for s in slots],
                              meta, fields)
        self.writer.save(payload, copy_in_background=background)
        self._last_saved = step

    def finish(self, trainer) -> None:
        """Wait for a background save; write the Hugging Face export (LoRA: the merged
        model) and the PEFT adapter folder if asked."""
        if self.cfg.export_peft:  # collective; the adapters only, gathered to rank 0
            from .foreign.peft import export_peft

            self.writer.wait()  # a background save's collectives are on self.group too
            export_peft(trainer.model, self.job.lora, Path(self.job.run.dir) / self.cfg.export_peft, self.topo,
                        optimizer=trainer.optimizer, base_model=self.job.model.hf_checkpoint, group=self.group)
        if self.export_dir is not None and self._last_saved != trainer.step:
            self.save(trainer)
        self.writer.wait()
        if self.export_dir is not None:
            if self.topo.rank == 0:
                from .convert import convert

                convert(self.root, self.export_dir, to="hf", progress=False, overwrite=True, merge_lora=True)
                if self.job.model.hf_checkpoint:  # fine-tuned: the source's tokenizer goes along
                    from .foreign.hf import copy_companion_files

                    copy_companion_files(self.job.model.hf_checkpoint, self.export_dir)
            if self.group is not None:
                dist.barrier(group=self.group)
        if self.reader is not None:
            self.reader.close()
