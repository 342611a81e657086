"""Rank 1 dies (SIGKILL) while rank 0 waits for it in a collective: the job must stop, not hang."""
import os
import signal
import time

import torch

from impel import Accelerator

acc = Accelerator()
acc.wait_for_everyone()
if acc.process_index == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
acc.reduce(torch.ones(1))  # rank 0 blocks here until the agent stops it or gloo notices the peer is gone
time.sleep(600)  # never reached in a healthy launcher: the test bounds its own time
