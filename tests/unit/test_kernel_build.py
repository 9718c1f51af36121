"""The kernels' build folder: a lock left by a process killed mid-build does not hang starts."""

from __future__ import annotations

import logging
import os
import threading
import time

from specdecode import kernels


def test_a_stale_build_lock_is_removed(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - kernels._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels"):
        kernels._clear_stale_lock(tmp_path)  # no build runs that long: left by a killed one
    assert not lock.exists() and "stale kernel build lock" in caplog.text
    kernels._clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_a_live_lock_is_waited_for_and_one_that_outlives_a_build_removed(
    tmp_path, caplog, monkeypatch
):
    lock = tmp_path / "lock"
    lock.write_text("")
    threading.Timer(0.5, lock.unlink).start()  # another process's load, done in 0.5 s
    start = time.monotonic()
    kernels._clear_stale_lock(tmp_path)
    assert 0.4 < time.monotonic() - start < 10.0 and not lock.exists()
    # a fresh lock whose process was killed: waited for until it is too old to be a build
    monkeypatch.setattr(kernels, "_STALE_LOCK_S", 1.0)
    monkeypatch.setattr(kernels, "_SAY_WAITING_S", 0.3)
    lock.write_text("")
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels"):
        kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "waiting for another process" in caplog.text and "stale" in caplog.text
