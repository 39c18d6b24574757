"""import_effects on its own, in a fresh interpreter (no Docker): what a reward's import changes is taken back after
the import and given back, as the import left it, in a process that runs reward code. The real sandboxes' steady
state under these hooks is tests/docker/test_steady_state.py's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import gc, json, os, posix, signal, socket, sys, types
    from rewardbox.sandbox.processes import import_effects

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
    def collected(phase, info):
        return None
    gc.callbacks.append(collected)
    signal.signal(signal.SIGUSR1, lambda *a: None)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    import posix
    os.register_at_fork(after_in_child=lambda: FORKED.append(posix.getpid()))
    class Liar:
        def __eq__(self, other):
            return True
        find_spec = staticmethod(lambda *a: None)
    sys.meta_path[0] = Liar()  # equal to anything: only an identity check sees it
    ARMED = []
    class Tracked(type(os)):
        def __getattribute__(self, name):
            if ARMED:
                raise AssertionError("the reward's module class ran")
            return super().__getattribute__(name)
    os.__class__ = Tracked
    class Environ(type(os.environ)):
        def get(self, *a):
            if ARMED:
                raise AssertionError("the reward's environ class ran")
            return super().get(*a)
    os.environ.__class__ = Environ
    import argparse
    argparse.RawDescriptionHelpFormatter.__bases__ = (type("Mixin", (argparse.HelpFormatter,), {"mixed": True}),)
    ARMED.append(True)
    """
    {audit}

    import argparse
    def state():
        return (types.ModuleType.__dict__["__dict__"].__get__(os)["unlink"], socket.socket.sendall,
                json.dumps.__code__, signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGPIPE),
                tuple(map(id, sys.meta_path)), type(os), type(os.environ),
                argparse.RawDescriptionHelpFormatter.__bases__)
    originals = state()


    def load():  # the template's own names stay out of what exists before the import (this module is one of them)
        snapshot = import_effects.watch("reward.py", refuse_audit_hooks=True)
        module = types.ModuleType("reward")
        exec(compile(REWARD, "reward.py", "exec"), module.__dict__)
        return module, import_effects.take(snapshot)


    module, why = load()
    taken_back = state()
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
        own = types.ModuleType.__dict__["__dict__"].__get__  # os's attributes: os is the reward's class here
        given = (json.dumps({}) == "patched" and own(os)["unlink"] is module.unlink and sys.gettrace() is module.tracer
                 and sys.getprofile() is module.tracer and module.collected in gc.callbacks
                 and signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL
                 and signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None)
                 and type(sys.meta_path[0]).__name__ == "Liar" and type(os).__name__ == "Tracked"
                 and type(own(os)["environ"]).__name__ == "Environ"
                 and getattr(argparse.RawDescriptionHelpFormatter, "mixed", False)
                 and module.FORKED == [posix.getpid()])
        sys.settrace(None)
        sys.setprofile(None)
        posix.write(write, b"1" if given else b"0")  # os is the reward's now: it raises once the import ended
        posix._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    report["given_back"] = os.read(read, 1) == b"1"  # nothing where the child failed before it wrote
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
    assert report["why"].startswith("reward.py:45: importing it adds an audit hook (sys.addaudithook)"), report["why"]
    assert "isolation: worker" in report["why"]


def test_an_import_that_changes_nothing_leaves_nothing_to_give_back_and_no_watch_armed():
    # Samples of such a reward (most rewards) pay nothing in their child; the refusal of audit hooks ends with the
    # import (an armed watch once read as the import's own change, and was put back armed in the template).
    script = textwrap.dedent('''
        import types
        from rewardbox.sandbox.processes import import_effects
        def load():
            snapshot = import_effects.watch("reward.py", refuse_audit_hooks=True)
            exec(compile("import re\\nPATTERN = re.compile('x')\\n", "reward.py", "exec"), {})
            return import_effects.take(snapshot)
        print(repr(load()), import_effects._taken is None, import_effects._watch.armed)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["''", "True", "False"], (done.stdout, done.stderr)
