"""The contract tests read a local model directory only: no hub lookups."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
