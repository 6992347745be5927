"""A rank's stop: the first SIGTERM / SIGINT becomes `Terminated`, later ones cannot cut short the failure record."""
import subprocess
import sys

SCRIPT = """
import os, signal, time
from common.process import Terminated, raise_on_termination, stopped_by
raise_on_termination()
raised = 0
for _ in range(3):  # torchrun's SIGTERM, then the kernel's when torchrun exits, then one more
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    except Terminated as exc:
        raised += 1
        print(exc)
print(raised, stopped_by())
"""


def test_only_the_first_stop_signal_raises():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["stopped by SIGTERM", "1 SIGTERM"]
