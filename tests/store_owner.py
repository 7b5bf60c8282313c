"""A fixture that runs a module's in-process buffers both ways (services/buffer/owner.py): the Store on
the event loop, and on a thread of its own. Import it into a test module to use it for every test."""

from __future__ import annotations

import pytest

from services.buffer import main as buffer_main


@pytest.fixture(autouse=True, params=["store-on-loop", "store-on-thread"])
def store_owner(request, monkeypatch):
    threaded = request.param == "store-on-thread"
    monkeypatch.setattr(buffer_main, "use_thread", lambda on, replay: (threaded, request.param))
    return threaded
