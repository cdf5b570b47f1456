"""Test-session settings: one intra-op thread.  The tests run tiny models where a second thread only adds
synchronisation overhead, and on a shared 2-core machine two threads per process contend badly."""

import torch

torch.set_num_threads(1)
