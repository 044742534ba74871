"""Stand-in for TensorFlow: the eager context (created or not) and get_memory_info."""

from __future__ import annotations

from .world import World, install, module


class LogicalDevice:
    def __init__(self, name):
        self.name = name


def install_tensorflow(monkeypatch, world: World, context_ready=True, current=None):
    """current: {device: bytes in use} for the GPUs TensorFlow made."""
    current = dict(current or {})
    state = {"ready": context_ready}

    def list_logical_devices(kind):
        if not state["ready"]:
            world.violations.append("tf.config.list_logical_devices made contexts on every GPU")
        return [LogicalDevice(f"/device:GPU:{i}") for i in sorted(current)]

    def get_memory_info(name):
        world.calls.append(("get_memory_info", name))
        return {"current": current[int(name.split(":")[1])], "peak": 0}

    ctx = module("ctx", _context_handle=object())
    context = module("tensorflow.python.eager.context", context_safe=lambda: ctx if state["ready"] else None)
    config = module("tensorflow.config", list_logical_devices=list_logical_devices,
                    experimental=module("experimental", get_memory_info=get_memory_info))
    tf = module("tensorflow", config=config)
    install(monkeypatch, {"tensorflow": tf, "tensorflow.python.eager.context": context})
    return state
