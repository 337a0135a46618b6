import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K_DIR = os.path.join(ROOT, "..", "shared", "data", "gsm8k")


@pytest.fixture
def gsm8k_dir():
    if not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")):
        pytest.skip("real GSM8K not found at ../shared/data/gsm8k")
    return GSM8K_DIR
