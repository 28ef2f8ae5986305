"""``strategy="sppo"`` without ``import lightning_sppo`` (issue 39 item 6): Lightning's connector refuses the name
before any code of ours runs (it has no plugin entry point for strategies), so the hint is in the troubleshooting
page, under the exact message Lightning prints; with the import, the same call works. Fresh interpreters: the
test process (and the preloaded server) imported the package, which registers the name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[2]
FABRIC = "from lightning.fabric import Fabric; Fabric(strategy='sppo', accelerator='cpu', devices=1)"
TRAINER = "from lightning.pytorch import Trainer; Trainer(strategy='sppo', accelerator='cpu', devices=1, logger=False)"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=one_thread_env(),
                          timeout=300)  # fmt: skip


@pytest.mark.slow  # four fresh interpreters importing torch and Lightning
@pytest.mark.parametrize("code", [FABRIC, TRAINER], ids=["fabric", "trainer"])
def test_the_documented_message_is_lightning_s_and_the_documented_fix_works(code: str):
    refused = _python(code)
    assert refused.returncode == 1, refused.stderr[-2000:]
    message = refused.stderr.strip().splitlines()[-1]
    said = re.search(r"You selected an invalid strategy name: `strategy='sppo'`", message)
    assert said, message  # the page quotes what Lightning says today
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert "You selected an invalid strategy name: `strategy='sppo'`" in page and "import lightning_sppo" in page
    fixed = _python(f"import lightning_sppo; {code}")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
