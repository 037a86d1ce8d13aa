"""``python tests/train/faulty_eslm.py ARGS...``: the ``eslm`` command with a SIGKILL injected (fault-injection tests).

ESLM_TEST_KILL="POINT:N" kills this process at the N-th (1-based) occurrence of POINT:
- ``step``: at the start of a training step (before any of its work);
- ``save``: inside an atomic checkpoint write (the .pt file or ``latest``), after half of its bytes;
- ``saveopen`` / ``savefull`` / ``savesum`` / ``saved``: the same writes, at other points of each: its temporary
  file created and empty; all its bytes written and fsynced, before its checksum; its checksum written, before
  the rename; renamed (the write done, before what follows: ``latest`` after the file, the pruning after it);
- ``metrics``: inside a metrics.jsonl write, after half of the line;
- ``snap``: inside a snapshot write (the temporary .safetensors file), after half of its bytes;
- ``fullsave`` / ``fullsnap``: not a kill: just before the N-th checkpoint / snapshot write, the file system of
  the run directory is filled (a file ``ESLM_TEST_FILLER`` grown until the disk is full), so the write itself
  meets a real ENOSPC. Only on a file system of at most 256 MiB (a test's tmpfs), never on a real disk.
Nothing is patched without the variable, so the same runner also gives the uninterrupted reference.
A process that leads its own process group (started with start_new_session, as a study is) kills the whole group.
"""

import io
import json
import os
import signal
import sys


def _kill():
    sys.stdout.flush()
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _write_half_and_kill(f, data) -> None:
    """Write the first half of ``data`` (at least one unit), flush it to the file, and die."""
    f.write(data[: max(1, len(data) // 2)])
    f.flush()
    os.fsync(f.fileno())
    _kill()


def _fill_disk() -> None:
    """Grow ESLM_TEST_FILLER until its (small) file system is full."""
    path = os.environ["ESLM_TEST_FILLER"]
    st = os.statvfs(os.path.dirname(path))
    if st.f_blocks * st.f_frsize > 256 * 2**20:
        raise SystemExit(f"refusing to fill {path}: its file system is larger than 256 MiB")
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
        try:  # the last partial block: fill it byte-wise so the next write of anyone fails
            while True:
                f.write(b"\0")
                f.flush()
        except OSError:
            pass


def install(point: str, n: int) -> None:
    import eslm.train.checkpoint as ckpt
    import eslm.train.snapshots as snaps
    from eslm.train.run_dir import MetricsWriter
    from eslm.train.trainer import Trainer

    calls = {"n": 0}

    def hit() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    def patch(owner, name: str, on_hit) -> None:
        """owner.name calls on_hit(real, *args, **kwargs) at its N-th call, the real function otherwise."""
        real = getattr(owner, name)
        setattr(owner, name, lambda *args, **kw: on_hit(real, *args, **kw) if hit() else real(*args, **kw))

    def half_file(real, path, write, *rest):  # the atomic write's payload, cut in half before the rename
        buf = io.BytesIO()
        buf.write(write) if isinstance(write, bytes) else write(buf)
        return real(path, lambda f: _write_half_and_kill(f, buf.getvalue()), *rest)

    def at(point):  # the atomic write killed at one point of its own (saveopen, savefull, savesum, saved)
        def on_hit(real, path, write, before_rename=None):
            if point == "saveopen":
                return real(path, lambda f: _kill(), before_rename)
            if point == "savefull":
                return real(path, write, lambda sha: _kill())
            if point == "savesum":
                return real(path, write, lambda sha: (before_rename and before_rename(sha), _kill()))
            real(path, write, before_rename)
            _kill()
        return on_hit

    def fill_then(real, *args, **kwargs):
        _fill_disk()
        return real(*args, **kwargs)

    if point == "step":
        patch(Trainer, "_train_one_step", lambda real, self: _kill())
    elif point == "save":
        patch(ckpt, "atomic_write", half_file)
    elif point in ("saveopen", "savefull", "savesum", "saved"):
        patch(ckpt, "atomic_write", at(point))
    elif point == "snap":
        patch(snaps, "atomic_write", half_file)
    elif point == "fullsave":
        patch(ckpt, "atomic_write", fill_then)
    elif point == "fullsnap":
        patch(snaps, "atomic_write", fill_then)
    elif point == "metrics":
        patch(MetricsWriter, "write", lambda real, self, record: _write_half_and_kill(
            self.file, json.dumps(record, default=str) + "\n"))
    else:
        raise SystemExit(f"unknown kill point {point!r}")


if __name__ == "__main__":
    spec = os.environ.get("ESLM_TEST_KILL")
    if spec:
        point, n = spec.split(":")
        install(point, int(n))
    from eslm.cli import main

    sys.exit(main(sys.argv[1:]))
