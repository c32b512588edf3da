"""The state dict codec: the optimizer's state on NVMe to and from torch's state dict, chunk by chunk.

The state dict has the wrapped optimizer's layout (for Adam/AdamW: ``step``,
``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``, fp32), plus
``master_param`` (fp32) for bf16/fp16 parameters, so it is interchangeable
with the wrapped optimizer's own. Chunks pass through one slot lent by the
worker, so host memory stays within the budget (plus the tensors returned).
"""

from __future__ import annotations

import torch

from nvoffload.optim._chunk_io import ChunkIO
from nvoffload.optim._layout import LOW_PRECISION, Record, Slot
from nvoffload.optim._pipeline import Pipeline
from nvoffload.optim._updates import Update


class StateCodec:
    """Reads and writes the state of ``records`` (the optimizer's list, shared) as a torch state dict."""

    def __init__(self, records: list[Record], io: ChunkIO, update: Update, pipeline: Pipeline):
        self._records = records
        self._io = io
        self._update = update
        self._pipeline = pipeline

    def state_dict(self, param_groups: list[dict]) -> dict:
        self._pipeline.wait_idle()
        state = {}
        with self._pipeline.lend() as slot:
            for rec in self._records:
                if rec.step == 0 or any(c.gen is None for c in rec.chunks):
                    continue
                state[rec.index] = self._gather(rec, slot)
        groups = []
        for g in param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [r.index for r in self._records if r.group is g]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def _gather(self, rec: Record, slot: Slot) -> dict:
        nrows = self._io.layout.rows(rec)
        full = torch.empty(nrows, rec.param.numel(), dtype=torch.float32)
        for c in rec.chunks:
            self._io.read(c, c.gen, slot).result()
            full[:, c.elements] = self._io.layout.chunk_rows(c, slot)
        shape = rec.param.shape
        st = self._update.scalar_state(rec)
        for i, key in enumerate(self._update.row_keys(rec, nrows)):
            st[key] = full[1 + i].view(shape).clone()
        if rec.param.dtype in LOW_PRECISION:
            st["master_param"] = full[0].view(shape).clone()
        return st

    def load_state_dict(self, state_dict: dict, param_groups: list[dict]) -> None:
        """Load ``state_dict`` into the store; the groups' hyperparameters are taken from it (as torch does).
        Parameters without a ``master_param`` entry use the model's current weights as master weights."""
        self._pipeline.wait_idle()
        groups = state_dict["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, optimizer has {len(param_groups)}")
        by_index = {}
        for g, saved in zip(param_groups, groups):
            recs = [r for r in self._records if r.group is g]
            if len(saved["params"]) != len(recs):
                raise ValueError(
                    f"loaded state dict contains a parameter group of {len(saved['params'])} parameters"
                    f" that doesn't match the size of optimizer's group ({len(recs)})"
                )
            by_index.update(zip(saved["params"], recs))
        for idx in state_dict["state"]:
            if idx not in by_index:
                raise ValueError(f"state for parameter {idx} has no matching parameter")
        for g, saved in zip(param_groups, groups):
            g.update((k, v) for k, v in saved.items() if k != "params")
        with self._pipeline.lend() as slot:
            for idx, rec in by_index.items():
                self._scatter(rec, state_dict["state"].get(idx), slot)

    def _scatter(self, rec: Record, st: dict | None, slot: Slot) -> None:
        for c in rec.chunks:
            self._io.discard(c)
        rec.step = 0
        if not st:
            return
        nrows = self._io.layout.rows(rec)
        shape = rec.param.shape
        master = st.get("master_param")
        tensors, scalars, rec.step = self._update.parse(rec, st, nrows)
        for t in [t for t in (master, *tensors) if t is not None]:
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"state tensor of shape {tuple(t.shape)} does not fit {rec.name}")
        for c in rec.chunks:
            rows = self._io.layout.chunk_rows(c, slot)
            rows.zero_()
            for i, t in enumerate(tensors, start=1):
                rows[i].copy_(t.detach().reshape(-1)[c.elements])
            if master is not None:
                rows[0].copy_(master.detach().reshape(-1)[c.elements])
            else:  # the model's current weights are the master
                with self._io.model_weights(rec, modify=False) as weights:
                    weights.read(c.elements, rows[0], slot)
            self._io.write_first(c, rows, dict(scalars))
