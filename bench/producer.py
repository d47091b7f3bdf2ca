"""Run one contender's producer side in a process of its own; print JSON.

``python producer.py MODULE enqueue N`` resets the contender (when it has
state outside Redis), then times only ``MODULE.enqueue(N)``: interpreter
start-up and imports are not enqueue cost. ``python producer.py MODULE check
N`` prints what the contender's own records say went wrong, if anything;
``reset`` only resets (N is ignored).
A process per call keeps the frameworks apart: Dramatiq sets a global broker
on import and Django can be set up once per process.
"""

from __future__ import annotations

import importlib
import json
import sys
import time


def main(argv: list[str]) -> int:
    module_name, action, count_text = argv
    module = importlib.import_module(module_name)
    count = int(count_text)
    if action == "enqueue":
        if hasattr(module, "reset"):
            module.reset()
        started = time.perf_counter()
        module.enqueue(count)
        print(json.dumps({"seconds": time.perf_counter() - started}))
    elif action == "reset":
        if hasattr(module, "reset"):
            module.reset()
        print(json.dumps({}))
    elif action == "check":
        problem = module.check(count) if hasattr(module, "check") else None
        print(json.dumps({"problem": problem}))
    else:
        raise SystemExit(f"Unknown action {action!r}: use enqueue, reset or check.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
