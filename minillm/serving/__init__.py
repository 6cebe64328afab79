"""An OpenAI-compatible HTTP server for minillm's engine (``python -m minillm serve``; FastAPI + uvicorn).

``protocol``: request and response bodies, errors. ``loop``: the engine on its own thread. ``app``: the
routes (``create_app``). ``launch``: start a server in a child process and stop it (tests, the book);
it needs only the standard library, so importing this package does not need FastAPI.
"""
from .launch import ServerProcess, launch_server

__all__ = ["ServerProcess", "launch_server"]
