"""An environment served over HTTP for Weir's multi-turn rollouts: "count the shapes".

Run it, then start the rollout role with it registered (only the operator names URLs; a request names
the environment)::

    python examples/environment_server.py --port 8200
    WEIR_HTTP_ENVIRONMENTS="count_shapes=http://127.0.0.1:8200" weir up

and send a prompt with ``"environment": {"name": "count_shapes", "options": {"seed": 7}}``.

The protocol is the one `rollout.environments.HttpEnvironment` speaks:

* ``POST /reset`` ``{"options", "messages", "group_id", "sample_index"}`` → ``{"session", "observation"}``.
  The observation is shown to the model as a ``user`` turn of the prompt, so it must depend only on the
  options (every sample of a group shares its prompt): here a picture drawn from ``options.seed``.
* ``POST /step`` ``{"session", "action"}`` with ``action`` ``{"text": ...}`` (the model's answer) or
  ``{"tool_call": {"name", "arguments"}}`` → ``{"observation", "reward", "done"}``.
* An observation is ``{"text": str, "images": [base64 PNG or JPEG]}`` or null.

The game: a picture with 1–5 shapes; the model answers how many. A wrong number gets a hint ("more" /
"fewer") and another try, up to ``options.tries`` (3); reward 1.0 for the right number on the first try,
0.5 on a later one, 0.0 otherwise. A tool call gets an ``error`` observation (this environment offers no
tools; `HttpEnvironment` sends every call here). Sessions live in memory, one per sample, and end with
``done`` (a real server would also expire abandoned ones).

Standalone on purpose: FastAPI, uvicorn, numpy and Pillow only — nothing of Weir's is imported.
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import threading
import uuid
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException
from PIL import Image, ImageDraw
from pydantic import BaseModel, Field

SIZE = 112  # pixels: the picture's side


def draw_shapes(seed: int) -> tuple[bytes, int]:
    """A PNG with 1–5 white shapes on dark noise, and how many."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 6))
    image = Image.fromarray(rng.integers(0, 60, size=(SIZE, SIZE, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    cells = rng.permutation(9)[:count]  # one shape per cell of a 3×3 grid: they never overlap
    for cell in cells:
        x, y = int(cell % 3) * 37 + 6, int(cell // 3) * 37 + 6
        if rng.random() < 0.5:
            draw.ellipse((x, y, x + 24, y + 24), fill=(255, 255, 255))
        else:
            draw.rectangle((x, y, x + 24, y + 24), fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue(), count


def observation(text: str, images: list[bytes] | None = None) -> dict[str, Any]:
    return {"text": text, "images": [base64.b64encode(i).decode() for i in images or []]}


class ResetBody(BaseModel):
    options: dict[str, Any] = Field(default_factory=dict)
    messages: list[Any] = Field(default_factory=list)
    group_id: str = ""
    sample_index: int = 0


class StepBody(BaseModel):
    session: str
    action: dict[str, Any]


def create_app() -> FastAPI:
    app = FastAPI(title="count the shapes")
    sessions: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()  # the rollout role calls from several worker threads at once

    @app.post("/reset")
    def reset(body: ResetBody) -> dict[str, Any]:
        seed, tries = body.options.get("seed", 0), body.options.get("tries", 3)
        if not isinstance(seed, int) or not isinstance(tries, int) or tries < 1:
            raise HTTPException(422, "options: seed and tries are integers, tries >= 1")
        picture, count = draw_shapes(seed)
        session = uuid.uuid4().hex
        with lock:
            sessions[session] = {"count": count, "tries_left": tries, "first": True}
        text = "How many white shapes are in this picture? Answer with the number only."
        return {"session": session, "observation": observation(text, [picture])}

    @app.post("/step")
    def step(body: StepBody) -> dict[str, Any]:
        with lock:
            state = sessions.get(body.session)
        if state is None:
            raise HTTPException(404, f"no session {body.session!r}")
        if "tool_call" in body.action:
            name = body.action["tool_call"].get("name")
            return {"observation": observation(f"error: no tool {name!r} here"), "reward": None, "done": False}
        found = re.search(r"\d+", str(body.action.get("text", "")))
        guess = int(found.group()) if found else None
        state["tries_left"] -= 1
        if guess == state["count"]:
            reward, done, hint = (1.0 if state["first"] else 0.5), True, None
        elif state["tries_left"] <= 0:
            reward, done, hint = 0.0, True, None
        else:
            reward, done = None, False
            hint = "Answer with a number." if guess is None else ("More." if guess < state["count"] else "Fewer.")
        state["first"] = False
        if done:
            with lock:
                sessions.pop(body.session, None)
        return {"observation": None if hint is None else observation(hint), "reward": reward, "done": done}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
