"""The demo restarts a child that died — its broker too, on the same port — says so, and gives up after
``MAX_RESTARTS``. Here with the embedded broker (no Mosquitto needed); tests/e2e/test_demo.py kills a demo's
Mosquitto mid-run and checks the rollout's accuracy."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from local_fleet.demo import CollectingView, Demo, DemoError, DemoOptions, MAX_RESTARTS, free_port, wait_for_port



def test_a_dead_broker_is_restarted_on_its_port_and_the_demo_says_so(tmp_path: Path) -> None:
    told = CollectingView()
    demo = Demo(DemoOptions(workdir=tmp_path, broker="embedded", devices=2, cells=1), told)
    port = free_port()
    try:
        demo.start_broker(port)
        [first] = demo.procs
        os.kill(first.popen.pid, signal.SIGKILL)
        first.popen.wait(10)
        demo.restart_dead()
        [second] = demo.procs
        assert second.popen.pid != first.popen.pid and second.restarts == 1 and second.argv == first.argv
        assert wait_for_port(port, 1.0)  # restart_dead returned once it listened again
        assert told.lines == [f"broker died (exit code -9); restarted it on 127.0.0.1:{port}, as a service manager "
                              f"would (restart 1; log {tmp_path / 'logs' / 'broker.log'})"]
        second.restarts = MAX_RESTARTS  # one that keeps dying stops the demo, with its log
        os.kill(second.popen.pid, signal.SIGKILL)
        second.popen.wait(10)
        with pytest.raises(DemoError, match="broker exited with code -9; last lines of"):
            demo.restart_dead()
    finally:
        demo.stop_all(grace_s=5)
