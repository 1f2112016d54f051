r"""Text a peer chose, made safe to write into a log line.

A client id, a metric name or the text of a refused message may carry newlines (a forged
second log line), terminal escape codes (ESC ``\x1b[...``: recoloured or erased lines on an
operator's terminal) or bidirectional overrides. :func:`safe` escapes every character that is
not printable, so what the log shows of it is one line of visible characters.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

#: At most this many characters of one value reach the log (the rest is elided).
MAX_LOGGED_CHARS = 2000


def safe(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    r"""``value`` as one printable line: control characters escaped, cut at ``limit`` chars.

    A newline comes out as the two characters ``\n``, ESC as ``\x1b``, a bidirectional
    override as ``\u202e``.
    """
    text = str(value)
    cut = len(text) > limit
    out = []
    for ch in text[:limit]:
        if ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out) + (f"... ({len(text)} chars)" if cut else "")


class RefusalLog:
    """Refusals of peers, logged one line per peer per ``interval`` seconds, never a traceback.

    A peer that sends bad messages in a loop must not flood the operator's log: the first
    refusal of a peer in an interval is written (its text through :func:`safe`); the others
    are counted, and the next line written for that peer says how many were not.

    Args:
        logger: Where the lines go (as warnings).
        interval: Seconds between two lines about the same peer.
        clock: Monotonic seconds (a test's fake clock).
        max_peers: Peers remembered at once; past it the memory starts afresh (a flood of
            new peers then logs one line each, which the transport's own limits bound).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = 4096,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._max_peers = max_peers
        self._peers: dict[str, tuple[float, int]] = {}  # peer -> (last line, refusals since)
        self._lock = threading.Lock()

    def warn(self, peer: str, fmt: str, *args: object) -> bool:
        """Log ``fmt % args`` about ``peer`` unless a line about it went out in the interval.

        String arguments pass through :func:`safe`. Returns whether a line was written.
        """
        with self._lock:
            now = self._clock()
            last, held = self._peers.get(peer, (-math.inf, 0))
            if now - last < self.interval:
                self._peers[peer] = (last, held + 1)
                return False
            if len(self._peers) >= self._max_peers and peer not in self._peers:
                self._peers.clear()
            self._peers[peer] = (now, 0)
        text = fmt % tuple(safe(a) if isinstance(a, str) else a for a in args)
        if held:
            text += f" ({held} more refusals of this peer in the last {self.interval:g} s unlogged)"
        self.logger.warning("%s", text)
        return True
