"""The messages of tests/support/shm_group.py's groups (send, recv: a ring per ordered pair of members), and what the
group's two halves share: the backend's name, the handles, byte arithmetic.

A sender copies its message into its ring to the receiver and goes on (buffered, as gloo's sends of the sizes the
suite uses complete before their receive); a receive completes at its handle's wait(), after the same source's
earlier receives, taking messages from the ring in order and matching them by tag, as gloo matches."""

import ctypes

import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

NAME = "megalite_shm"
_CTRL = 192  # per member: posted, completed, pid; per ring: written, read (a cache line each)


class _Work(dist.Work):
    """A handle whose wait() runs `complete` (once)."""

    def __init__(self, complete, result):
        super().__init__()
        self._complete, self._result, self._finished = complete, result, False

    def wait(self, timeout=None):
        if not self._finished:
            self._complete()
            self._finished = True
        return True

    def is_completed(self):
        return self._finished

    def get_future(self):
        self.wait()
        fut = Future()
        fut.set_result(self._result)
        return fut


def _done(result):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class Messages:
    """send / recv of a ShmGroup (its memory, lock and waiting: _mm, _bytes, _word, _lock, _wait_until, _publish;
    _rings_at, _ring_bytes, _receives, _stash set up by the group)."""

    def _ring(self, src, dst):
        at = self._rings_at + (src * self._size + dst) * (_CTRL + self._ring_bytes)
        return self._word(at), self._word(at + 64), at + _CTRL  # bytes written, bytes read, the ring

    def send(self, tensors, dst, tag):
        (t,) = tensors
        n = _nbytes(t)
        size = 64 + _padded(n)  # a 64-byte header (tag, byte count), then the bytes
        if size > self._ring_bytes:
            raise RuntimeError(f"{NAME}: a send of {size} bytes exceeds the group's ring of {self._ring_bytes} "
                               "(tests/support/shm_group.py RING)")
        with self._lock:
            written, read, ring = self._ring(self._rank, dst)
            start = written.value
            w, pos = start, start % self._ring_bytes
            if pos + size > self._ring_bytes:  # a message never wraps: the rest of the ring is skipped
                w, pos = w + self._ring_bytes - pos, 0
            self._wait_until(read, w + size - self._ring_bytes, dst, "receives, to free ring space")
            if w != start:
                (ctypes.c_int64 * 2).from_buffer(self._mm, ring + start % self._ring_bytes)[:] = [-1, 0]
            (ctypes.c_int64 * 2).from_buffer(self._mm, ring + pos)[:] = [tag, n]
            self._bytes[ring + pos + 64:ring + pos + 64 + n].view(t.dtype).view(t.shape).copy_(t)
            self._publish(written, w + size)
        return _done(tensors)

    def recv(self, tensors, src, tag):
        (t,) = tensors
        entry = [t, tag, False]
        with self._lock:
            self._receives[src].append(entry)
        return _Work(lambda: self._complete_receives(src, entry), tensors)

    def _complete_receives(self, src, entry):
        with self._lock:
            queue = self._receives[src]
            while not entry[2]:
                self._match(src, *queue[0][:2])
                queue.pop(0)[2] = True

    def _match(self, src, t, tag):
        stash = self._stash[src]
        while True:
            for i, (got, payload) in enumerate(stash):
                if got == tag:
                    stash.pop(i)
                    if payload.numel() != _nbytes(t):
                        raise RuntimeError(f"{NAME}: received {payload.numel()} bytes from member {src} "
                                           f"(tag {tag}) into a tensor of {_nbytes(t)}")
                    t.copy_(payload.view(t.dtype).view(t.shape))
                    return
            stash.append(self._pull(src))

    def _pull(self, src):
        """The next message from src's ring, copied out (so its bytes are free again)."""
        written, read, ring = self._ring(src, self._rank)
        while True:
            r = read.value
            self._wait_until(written, r + 1, src, "send")
            pos = r % self._ring_bytes
            tag, n = (ctypes.c_int64 * 2).from_buffer(self._mm, ring + pos)
            if tag == -1:  # the sender skipped the rest of the ring
                self._publish(read, r + self._ring_bytes - pos)
                continue
            payload = self._bytes[ring + pos + 64:ring + pos + 64 + n].clone()
            self._publish(read, r + 64 + _padded(n))
            return tag, payload


def _nbytes(t):
    return t.numel() * t.element_size()


def _padded(n):
    return (n + 63) // 64 * 64
