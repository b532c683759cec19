"""The example's guess-the-number OpenEnv server with faults to inject, for tests/plugins/test_openenv_env.py.

Served with uvicorn (``faulty_guess:app``, app dir: this folder); the faults are read from environment variables
when the server starts:

* ``GUESS_PID_FILE``: write the server's pid there (a test checks the process is gone afterwards);
* ``GUESS_SLOW_S``: every step sleeps this long before answering (a server that answers slowly);
* ``GUESS_DIE_AFTER`` with ``GUESS_DIE_MARKER``: the process exits abruptly on its N-th step, once: the marker file
  records that it died, so a restarted server plays on (a server that dies mid-episode).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "openenv_game"))

from guess_number import GuessAction, GuessNumberEnvironment, GuessObservation, make_app

_SLOW_S = float(os.environ.get("GUESS_SLOW_S", "0"))
_DIE_AFTER = int(os.environ.get("GUESS_DIE_AFTER", "0"))
_DIE_MARKER = os.environ.get("GUESS_DIE_MARKER", "")
_steps = 0

if os.environ.get("GUESS_PID_FILE"):
    Path(os.environ["GUESS_PID_FILE"]).write_text(str(os.getpid()))


class FaultyGuessEnvironment(GuessNumberEnvironment):
    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        global _steps
        _steps += 1
        if _DIE_AFTER and _steps >= _DIE_AFTER and _DIE_MARKER and not Path(_DIE_MARKER).exists():
            Path(_DIE_MARKER).write_text("died")
            os._exit(1)  # mid-episode, without answering: what a crashed server does
        if _SLOW_S:
            time.sleep(_SLOW_S)
        return super().step(action, timeout_s=timeout_s, **kwargs)


app = make_app(FaultyGuessEnvironment)
