"""What the ranks print, shown while they run: one live display in the notebook cell.

A launch replays its ranks' output in rank order when it ends (deterministic, so nbval can
compare it). Until then a cell would be silent: for a training run, seconds; for a hang,
the whole timeout. In a Jupyter kernel, :class:`LiveOutput` therefore shows the ranks'
latest lines as they arrive and, after a second, which ranks are still running (also for a
launch that shows nobody's output, such as an exercise check's: a hang is seen at once).

Why it cannot disturb the stored or the compared outputs: the display starts *empty*, is
filled by ``update_display_data`` messages, and is emptied again when the launch ends.
It is created only once there is something to show (after ``SHOW_AFTER`` seconds): a quick
launch leaves no output behind at all, not even an empty one in the notebook a student saves.
``nbclient`` (the build) applies the updates: it stores an empty display. ``nbval`` ignores
updates: it sees the empty display it was created as. An empty display has no data, so it
compares equal under both, and nbval merges the stream output around it (the replay) into one.

An emptied display is still an output: JupyterLab saves it (``{"output_type": "display_data",
"data": {}}``), and no message removes one output, only ``clear_output``, which removes all of
the cell's (JupyterLab 4.6, nbclient 0.11). So at the end the cell is cleared and what it showed
before the display is shown again: :func:`count_outputs` notes each cell's outputs as they are
sent (in :data:`CELL`), and :meth:`LiveOutput.close` sends ``clear_output(wait=True)`` (cleared
when the next output arrives: no flicker) and then those outputs again. JupyterLab, classic
Notebook, VS Code, Colab and nbclient all apply ``clear_output``; nbval 0.11 ignores it (it
would see the earlier outputs twice), so the course's conftest.py teaches nbval to apply it as
nbclient does. Where the cell's outputs are not known (the cell that imported course, a kernel
that sends them otherwise) or hold something that cannot be sent again as it was (an
``execute_result``, an ``error``), the display is only emptied, and stays in a saved notebook
(``python -m course build`` drops it from the solutions). Outside Jupyter nothing is shown.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from course.runtime.worker import Job, NoiseFilter

TICK = 0.25  # seconds between looks at the ranks' output files
SHOW_AFTER = 0.5  # seconds: a quick launch shows only its replay, without flicker
STATUS_AFTER = 1.0  # seconds after which the display also says which ranks still run
LINES = 20  # the display keeps the latest lines only


_counting = []  # the shells count_outputs has hooked
OUTPUTS = ("stream", "display_data", "execute_result", "error")  # what a cell's output area keeps
RESENDABLE = ("stream", "display_data")  # what close() can send again exactly as it was


class CellOutputs:
    """The outputs the running cell has sent so far. One per kernel, :data:`CELL`, and only its
    methods change them: :func:`count_outputs` calls :meth:`sent` for each message and
    :meth:`reset` when a cell starts; :meth:`LiveOutput.close` reads them and, having cleared the
    cell itself, calls :meth:`reset` before it sends them again."""

    def __init__(self, outputs=None):
        self._outputs = outputs

    @property
    def outputs(self):
        """``[(kind, content), ...]`` in the order sent, or None: not known (e.g. in the cell that
        imported course)."""
        return self._outputs

    def reset(self):
        """Nothing sent yet: a cell starts, or is about to be filled again after a clear."""
        self._outputs = []

    def sent(self, kind, content):
        """Note a message of type ``kind`` the kernel sends: an output is added, a display's update
        applied to it, and a ``clear_output`` empties them (``wait=True`` clears only at the
        next output: not known meanwhile)."""
        if kind == "clear_output":
            self._outputs = None if content.get("wait") else []
        elif kind in OUTPUTS and self._outputs is not None:
            self._outputs.append((kind, dict(content)))
        elif kind == "update_display_data" and self._outputs is not None:
            for _, shown in self._outputs:
                if _display_id(shown) == _display_id(content):
                    shown.update(data=content.get("data", {}), metadata=content.get("metadata", {}))


CELL = CellOutputs()


def count_outputs(shell):
    """In a Jupyter kernel (``shell``: IPython's), note each cell's outputs as ipykernel sends them,
    from the cell's start: its streams (sent from its I/O thread) and displays go through one
    ``Session.send``, which this wraps; a display's updates are applied to what was noted. Once
    per kernel; a kernel that sends them otherwise notes nothing (a live display is then always
    emptied, never cleared)."""
    session = getattr(getattr(shell, "kernel", None), "session", None)
    senders = (getattr(sys.stdout, "session", None), getattr(sys.stderr, "session", None),
               getattr(shell.display_pub, "session", None))
    if session is None or any(s is not session for s in senders) or any(c is shell for c in _counting):
        return
    _counting.append(shell)
    send = session.send

    def counted(stream, msg_or_type, content=None, *args, **kwargs):
        kind = msg_or_type if isinstance(msg_or_type, str) else msg_or_type["header"]["msg_type"]
        CELL.sent(kind, (content if isinstance(msg_or_type, str) else msg_or_type["content"]) or {})
        return send(stream, msg_or_type, content, *args, **kwargs)

    session.send = counted
    shell.events.register("pre_run_cell", lambda info: CELL.reset())


def _display_id(content):
    return (content.get("transient") or {}).get("display_id")


def in_jupyter() -> bool:
    """True in a Jupyter kernel (where a display can be updated), False in a script or a terminal."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


class LiveOutput:
    """Reads the ranks' output files from where it last stopped and shows the newest lines."""

    def __init__(self, job: Job, ranks):
        self.job, self.ranks = job, list(ranks)
        self.offsets = {r: 0 for r in self.ranks}
        self.partial = {r: b"" for r in self.ranks}
        self.lines = deque(maxlen=LINES)
        self.noise = NoiseFilter()
        self.started = time.monotonic()
        self.shown = ""
        self.handle = None  # created, empty, when there is something to show

    def update(self, running):
        """Show new lines, and after STATUS_AFTER seconds the ranks in ``running``."""
        elapsed = time.monotonic() - self.started
        if elapsed < SHOW_AFTER:
            return
        for rank in self.ranks:
            self._read(rank)
        lines = list(self.lines)
        if running and elapsed >= STATUS_AFTER:
            lines.append(f"… {elapsed:.0f} s, still running: rank(s) {', '.join(map(str, running))}")
        text = "\n".join(lines)
        if text.strip() and text != self.shown:
            if self.handle is None:
                from IPython.display import display

                self.handle = display(display_id=True)  # empty: what nbval compares (see above)
            self.shown = text  # first: an interrupt inside update() must still let close() empty it
            self.handle.update({"text/plain": text}, raw=True)

    def close(self):
        """Take the display away before the launch's rank-ordered replay follows: clear the cell
        and show again what it showed before the display (see the module's doc), or, where that
        is not known, empty the display."""
        if not self.shown:
            return
        sys.stdout.flush()  # anything printed meanwhile is sent, and noted, before we look
        sys.stderr.flush()
        before = CELL.outputs
        if before is not None:
            before = [(kind, c) for kind, c in before if _display_id(c) != self.handle.display_id]
        if before is None or any(kind not in RESENDABLE for kind, _ in before):
            self.handle.update({}, raw=True)
            return
        from IPython.display import clear_output, publish_display_data

        clear_output(wait=bool(before))  # wait: the cell is cleared as the first output comes again
        CELL.reset()  # count_outputs noted "not known" (a wait=True clear), but this clear is ours:
        # what is sent again from here is all the cell holds, and is noted again
        for kind, content in before:
            if kind == "stream":
                out = sys.stderr if content.get("name") == "stderr" else sys.stdout
                out.write(content.get("text", ""))
                out.flush()  # in order with the displays around it
            else:
                publish_display_data(content.get("data", {}), content.get("metadata"),
                                     transient=content.get("transient"))

    def _read(self, rank):
        try:
            with open(self.job.output_path(rank), "rb") as f:
                f.seek(self.offsets[rank])
                new = f.read()
        except FileNotFoundError:
            return
        self.offsets[rank] += len(new)
        *complete, self.partial[rank] = (self.partial[rank] + new).split(b"\n")
        for raw in complete:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if self.noise.keep(line):
                self.lines.append(f"[rank {rank}] {line}")
