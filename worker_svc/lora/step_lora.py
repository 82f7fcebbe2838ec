"""One step's adapters: which device slot each packed token's row runs (-1: the base model),
and the index forms the backends' products take, made on first use."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.lora.adapter_slots import SiteSlots


@dataclass(slots=True)
class StepLora:
    layers: list[dict[str, SiteSlots]]  # the device slots, per layer and site
    token_slots: np.ndarray  # int64 [T]: each token's slot, -1 where its row has no adapter
    num_slots: int  # every token's slot is below it: the products span slots [0, num_slots)
    device: torch.device
    _one_hot: torch.Tensor | None = None
    _by_slot: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        layers: list[dict[str, SiteSlots]],
        request_slots: np.ndarray,  # per packed request
        num_scheduled: np.ndarray,  # its tokens this step
        device: torch.device,
    ) -> StepLora:
        token_slots = np.repeat(request_slots.astype(np.int64), num_scheduled)
        return cls(layers, token_slots, int(request_slots.max()) + 1, device)

    def one_hot(self) -> torch.Tensor:
        """[T, num_slots] float32 on the device: 1 at each token's slot (a row of zeros: none)."""
        if self._one_hot is None:
            hot = np.zeros((len(self.token_slots), self.num_slots), dtype=np.float32)
            rows = np.flatnonzero(self.token_slots >= 0)
            hot[rows, self.token_slots[rows]] = 1
            self._one_hot = torch.from_numpy(hot).to(self.device)
        return self._one_hot

    def by_slot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens that run an adapter, grouped by slot (int64), and their slots (int32)."""
        if self._by_slot is None:
            rows = np.flatnonzero(self.token_slots >= 0)
            rows = rows[np.argsort(self.token_slots[rows], kind="stable")]
            slots = self.token_slots[rows].astype(np.int32)
            self._by_slot = torch.from_numpy(rows), torch.from_numpy(slots)
        return self._by_slot
