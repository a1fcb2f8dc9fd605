"""A race checker for Triton's interpreter, which runs a program's operations one after
another and ignores tl.debug_barrier, so a race only a GPU shows passes there.

Under `races()`, every global load and store of the interpreted kernels is recorded by
byte. Between two barriers of one program it flags a load of a byte another thread
stored, a store to a byte another thread loaded, and stores of different values to one
byte by different threads; across the programs of one launch, any byte one program
stores and another loads or stores. A thread is an element of an operation's block; a
block of fewer elements than 8 warps' 256 threads is spread over every warp, so two
accesses in one are never the same thread's. Slow (Python per byte): tiny shapes.
"""

import collections
import contextlib
import os
import traceback
from unittest import mock

import numpy as np

_THREADS = 256


def _where():
    """The library's frames of the access, innermost first."""
    frames = [f for f in traceback.extract_stack()
              if os.sep + "torch_fce" + os.sep in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}"
                       for f in reversed(frames[-3:]))


@contextlib.contextmanager
def races():
    """Yields a Counter of (kind, where, where before) -> flagged bytes, filled as the
    interpreted kernels under it run."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load0, store0 = builder.create_masked_load, builder.create_masked_store
    barrier0, grid0 = builder.create_barrier, builder.set_grid_idx
    flags = collections.Counter()
    state = dict(op=0, pid=None, loads={}, stores={}, launch_loads={}, launch_stores={})

    def accesses(ptrs, mask, value=None):
        """(byte, thread, value byte) of each access of an operation."""
        state["op"] += 1
        shape = np.asarray(ptrs.data).shape
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        addrs = np.asarray(ptrs.data).reshape(-1).astype(np.uint64)
        live = np.nonzero(np.broadcast_to(np.asarray(mask.data), shape).reshape(-1))[0]
        vals = None if value is None else \
            np.broadcast_to(np.asarray(value.data), shape).reshape(-1)
        spread = int(np.prod(shape)) < _THREADS
        for i in live:
            thread = ("spread", state["op"], int(i)) if spread else (shape, int(i))
            data = None if vals is None else np.asarray(vals[i]).tobytes()
            for j in range(size):
                yield int(addrs[i]) + j, thread, None if data is None else data[j]

    def same(a, b):
        return a == b and a[0] != "spread"

    def load(self, ptrs, mask, *args):
        where = _where()
        for byte, thread, _ in accesses(ptrs, mask):
            stored = state["stores"].get(byte)
            if stored is not None and not same(stored[0], thread):
                flags["read after another thread's write", where, stored[2]] += 1
            state["loads"].setdefault(byte, []).append((thread, where))
            other = state["launch_stores"].get(byte)
            if other is not None and other[0] != state["pid"]:
                flags["read of another program's write", where, other[1]] += 1
            state["launch_loads"].setdefault(byte, set()).add(state["pid"])
        return load0(self, ptrs, mask, *args)

    def store(self, ptrs, value, mask, *args):
        where = _where()
        for byte, thread, data in accesses(ptrs, mask, value):
            for reader, read_at in state["loads"].get(byte, ()):
                if not same(reader, thread):
                    flags["write after another thread's read", where, read_at] += 1
                    break
            stored = state["stores"].get(byte)
            if stored is not None and not same(stored[0], thread) and stored[1] != data:
                flags["two threads' writes of different values", where, stored[2]] += 1
            state["stores"][byte] = (thread, data, where)
            other = state["launch_stores"].get(byte)
            if other is not None and other[0] != state["pid"]:
                flags["writes of two programs", where, other[1]] += 1
            if state["launch_loads"].get(byte, set()) - {state["pid"]}:
                flags["write of another program's read", where, ""] += 1
            state["launch_stores"][byte] = (state["pid"], where)
        return store0(self, ptrs, value, mask, *args)

    def barrier(self):
        state["loads"], state["stores"] = {}, {}
        return barrier0(self)

    def grid(self, x, y, z):
        if (x, y, z) == (0, 0, 0):  # a launch's first program
            state["launch_loads"], state["launch_stores"] = {}, {}
        state["pid"] = (x, y, z)
        state["loads"], state["stores"] = {}, {}
        return grid0(self, x, y, z)

    with mock.patch.multiple(builder, create_masked_load=load, create_masked_store=store,
                             create_barrier=barrier, set_grid_idx=grid):
        yield flags
