"""How a change to a shared class or module attribute is made, and taken back.

A change to an attribute every thread and model shares (a module's function, a class's
method) is made here, one of two ways:

* ``ThreadScopedPatch``: in force while some thread is inside ``active(hook)``, and only for
  the threads inside: the replacement calls ``hook`` for them and the original for every
  other thread. The attribute is put back when the last thread leaves.
* ``HeldPatch``: in force while any holder (a ``TofuStrategy``) is alive; the original comes
  back when the last one is garbage-collected (``weakref.finalize``).

Both restore the attribute exactly: the original value where the owner's own ``__dict__``
held one, removed where the attribute was inherited. Neither knows TensorFlow or Keras: the
concrete changes are in ``tofu_tf.tf.compat.process``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Callable, Iterator

from absl import logging

from tofu_tf.tf.compat.registry import Change

_MISSING = object()


class _Slot:
    """An attribute of a shared owner that a replacement takes, and how to put it back."""

    def __init__(self, change: Change, locate: Callable[[], tuple[object, str]]):
        self.change = change
        self._locate = locate
        self._owner = self._name = None
        self._saved = _MISSING
        self.original = None

    def install(self, make_replacement: Callable[[Callable], Callable]) -> None:
        self._owner, self._name = self._locate()
        self._saved = vars(self._owner).get(self._name, _MISSING)
        self.original = getattr(self._owner, self._name)
        replacement = make_replacement(self.original)
        replacement._tofu_change = self.change.name  # pylint: disable=protected-access
        setattr(self._owner, self._name, replacement)

    def restore(self) -> None:
        current = vars(self._owner).get(self._name)
        if getattr(current, "_tofu_change", None) != self.change.name:
            logging.warning("tofu_tf: %s: %s.%s was replaced again since tofu_tf replaced it; left as it is",
                            self.change.name, getattr(self._owner, "__name__", self._owner), self._name)
        elif self._saved is _MISSING:
            delattr(self._owner, self._name)
        else:
            setattr(self._owner, self._name, self._saved)
        self._owner = self._name = self.original = None
        self._saved = _MISSING


class ThreadScopedPatch:
    """``change``, in force for the threads inside ``active(hook)`` (see the module docstring).

    ``locate()`` returns (owner, attribute name); it is called when the first thread enters,
    so the framework module is imported only then. ``hook(original, *args, **kwargs)`` runs
    in place of the original for the threads inside; nested ``active`` calls on one thread
    use the innermost hook.
    """

    def __init__(self, change: Change, locate: Callable[[], tuple[object, str]]):
        self.change = change
        self._slot = _Slot(change, locate)
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()

    @property
    def installed(self) -> bool:
        return self._users > 0

    @contextlib.contextmanager
    def active(self, hook: Callable) -> Iterator[None]:
        hooks = self._hooks()
        with self._lock:
            if self._users == 0:
                self._slot.install(self._replacement)
            self._users += 1
        hooks.append(hook)
        try:
            yield
        finally:
            hooks.pop()
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._slot.restore()

    def _hooks(self) -> list:
        hooks = getattr(self._local, "hooks", None)
        if hooks is None:
            hooks = self._local.hooks = []
        return hooks

    def _replacement(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def replacement(*args, **kwargs):
            hooks = getattr(self._local, "hooks", None)
            if not hooks:
                return original(*args, **kwargs)
            return hooks[-1](original, *args, **kwargs)
        return replacement


class HeldPatch:
    """``change``, in force while any holder is alive (see the module docstring).

    ``make_replacement(original)`` builds the replacement; ``locate()`` returns (owner,
    attribute name), or None while the owner cannot be had without cost (tf-keras not yet
    imported by the user): ``refresh()`` tries again later.
    """

    def __init__(self, change: Change, locate: Callable[[], tuple[object, str] | None],
                 make_replacement: Callable[[Callable], Callable]):
        self.change = change
        self._locate = locate
        self._make_replacement = make_replacement
        self._slot: _Slot | None = None
        # Reentrant: a garbage collection inside ``refresh`` may finalize a holder on this thread.
        self._lock = threading.RLock()
        self._holders = 0

    @property
    def installed(self) -> bool:
        return self._slot is not None

    @property
    def holders(self) -> int:
        return self._holders

    def hold(self, holder) -> None:
        """Keep the change in force while ``holder`` is alive (and install it now if it can be)."""
        with self._lock:
            self._holders += 1
        finalizer = weakref.finalize(holder, self._release)
        finalizer.atexit = False          # nothing to restore for a process that is ending
        self.refresh()

    def refresh(self) -> None:
        """Install the change if it is held and not installed yet."""
        with self._lock:
            if self._holders == 0 or self._slot is not None:
                return
            located = self._locate()
            if located is None:
                return
            slot = _Slot(self.change, lambda: located)
            slot.install(self._make_replacement)
            self._slot = slot
            logging.info("tofu_tf: %s installed (%s)", self.change.name, self.change.replaces)

    def _release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._slot is not None:
                self._slot.restore()
                self._slot = None
                logging.info("tofu_tf: %s undone: no TofuStrategy is alive", self.change.name)
