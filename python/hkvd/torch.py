"""A small torch helper: look up a batch of ids as a tensor, write rows back.

Needs torch; importing this module without it raises ImportError.
"""

from __future__ import annotations

import numpy as np
import torch

from . import Client


class EmbeddingCache:
    """Rows of one hkvd table as torch tensors.

    ``lookup(ids)`` returns a float32 tensor of shape (len(ids), dim): stored
    rows for known ids, and for unknown ids rows from ``init`` (zeros by
    default), which are inserted so the next lookup finds them.
    ``write_back(ids, rows)`` stores updated rows (``insert_or_assign``).
    """

    def __init__(self, client: Client, table: str, init=None):
        self.client = client
        self.table = table
        self.dim = client.dim(table)
        self.init = init

    def _ids(self, ids) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        return np.ascontiguousarray(ids).astype(np.int64, copy=False).view(np.uint64).reshape(-1)

    def lookup(self, ids) -> torch.Tensor:
        keys = self._ids(ids)
        if self.init is None:
            rows = np.zeros((keys.size, self.dim), dtype=np.float32)
        else:
            rows = np.asarray(self.init(keys.size, self.dim), dtype=np.float32)
        return torch.from_numpy(self.client.find_or_insert(self.table, keys, rows))

    def write_back(self, ids, rows: torch.Tensor) -> None:
        keys = self._ids(ids)
        values = rows.detach().to(torch.float32).cpu().numpy()
        self.client.insert_or_assign(self.table, keys, values)
