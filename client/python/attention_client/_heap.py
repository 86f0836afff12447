"""Requests of about a MiB and glibc's malloc (docs/python.md, "Performance").

glibc gives the top of its heap back to the kernel when a block of 64 KiB or
more is freed (with the free blocks beside it) and more than its trim
threshold then lies free at the top. That threshold is twice the largest
block it has handed out by mmap and taken back since the program started
(128 KiB before any; at most 64 MiB). In a program that has freed no block
larger than its requests it is about two requests, and a call frees more
than that at once (the request's bytes, grpcio's copy of them, the answer's
bytes): the heap then shrinks after every call, and the next call faults its
pages back in. For 0.75 MiB requests that was 80-170 page faults per call
and 2.5-3x the call's time, in a program that did nothing but call.

Freeing one 8 MiB block raises the thresholds to 8 MiB (blocks under it come
from the heap) and 16 MiB (trim), as glibc does after any program frees such
a block, and requests up to a few MiB then stay in the heap from call to
call. keep() does that once, at the first request of 64 KiB or more, unless
the environment sets malloc's parameters itself or the C library is not glibc.
"""
import ctypes
import os
import threading

_BLOCK = 8 << 20
_SMALL = 64 << 10  # freeing blocks under 64 KiB never trims
# What sets glibc's malloc parameters from the environment (and fixes them).
_MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                       "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_done = False


def _glibc():
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def _environment_sets_malloc():
    return ("glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
            or any(name in os.environ for name in _MALLOC_ENVIRONMENT))


def keep(nbytes):
    """Before or after making a request of `nbytes` bytes: the first time
    one has 64 KiB or more, frees an 8 MiB block that malloc gave by mmap."""
    global _done
    if _done or nbytes < _SMALL:
        return
    with _lock:
        if _done:
            return
        _done = True
    if not _glibc() or _environment_sets_malloc():
        return
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.restype = None
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.free(libc.malloc(_BLOCK))  # mapped and unmapped: only its header's page is touched
