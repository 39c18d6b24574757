"""import_effects on its own, in a fresh interpreter (no Docker): what a reward's import changes is taken back after
the import and given back, as the import left it, in a process that runs reward code. The real sandboxes' steady
state under these hooks is tests/docker/test_steady_state.py's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import gc, json, os, signal, socket, sys, types
    from rewardbox.sandbox import import_effects

    REWARD = """
    import gc, os, signal, socket, sys, json
    FORKED = []
    def unlink(*a, **k):
        raise AssertionError("the reward's unlink ran")
    os.unlink = unlink
    socket.socket.sendall = lambda self, data: None
    json.dumps.__defaults__ = None
    def _dumps(obj, **kw):
        return "patched"
    json.dumps.__code__ = _dumps.__code__
    def tracer(frame, event, arg):
        return None
    sys.settrace(tracer)
    sys.setprofile(tracer)
    gc.callbacks.append(tracer)
    signal.signal(signal.SIGUSR1, lambda *a: None)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.register_at_fork(after_in_child=lambda: FORKED.append(os.getpid()))
    sys.meta_path.insert(0, type("Finder", (), {"find_spec": staticmethod(lambda *a: None)})())
    """
    {audit}

    originals = (os.unlink, socket.socket.sendall, json.dumps.__code__, signal.getsignal(signal.SIGUSR1),
                 signal.getsignal(signal.SIGPIPE), len(sys.meta_path))


    def load():  # the template's own names stay out of what exists before the import (this module is one of them)
        snapshot = import_effects.watch("reward.py", refuse_audit_hooks=True)
        module = types.ModuleType("reward")
        exec(compile(REWARD, "reward.py", "exec"), module.__dict__)
        return module, import_effects.take(snapshot)


    module, why = load()
    taken_back = (os.unlink, socket.socket.sendall, json.dumps.__code__, signal.getsignal(signal.SIGUSR1),
                  signal.getsignal(signal.SIGPIPE), len(sys.meta_path))
    report = {
        "why": why,
        "taken_back": taken_back == originals and sys.gettrace() is None and sys.getprofile() is None
                      and not gc.callbacks,
        "forked_in_parent": module.FORKED,
    }
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        import_effects.give_back()
        given = (os.unlink is module.unlink and json.dumps({}) == "patched" and sys.gettrace() is module.tracer
                 and sys.getprofile() is module.tracer and module.tracer in gc.callbacks
                 and signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL
                 and signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None)
                 and len(sys.meta_path) == originals[5] + 1 and module.FORKED == [os.getpid()])
        sys.settrace(None)
        sys.setprofile(None)
        os.write(write, b"1" if given else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    report["given_back"] = os.read(read, 1) == b"1"
    print(json.dumps(report))
''')


def run(audit: str = "") -> dict:
    import json
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("{audit}", audit)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_what_the_import_changed_is_taken_back_and_given_back_only_where_reward_code_runs():
    report = run()
    assert report == {"why": "", "taken_back": True, "forked_in_parent": [], "given_back": True}


def test_an_audit_hook_added_at_import_is_refused_naming_the_line():
    report = run(audit='REWARD += "\\nsys.addaudithook(lambda event, args: None)\\n"')
    assert report["why"].startswith("reward.py:22: importing it adds an audit hook (sys.addaudithook)"), report["why"]
    assert "isolation: worker" in report["why"]
