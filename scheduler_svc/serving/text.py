"""From generated token ids to text deltas: never split a character, honour stop strings.

`TextStream` feeds ids to the tokenizer's incremental decoder (`tokenizers.decoders.DecodeStream`,
which holds back bytes until they form whole UTF-8 characters) and holds back any tail that
could still become a stop string. The concatenation of every delta it returns equals the text of
the whole answer: `tokenizer.decode(ids)`, cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    """Incremental detokenizer with stop strings, for one generated sequence."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.ids: list[int] = []
        # What each id added to the decoded text ("" for one that only begins a character; the
        # id that completes it carries the character), stop strings not applied.
        self.token_texts: list[str] = []
        self.text = ""  # emitted so far
        self._held = ""  # decoded, not yet emitted (might begin a stop string)
        self.stopped = False

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; return the text that became safe to emit (possibly empty)."""
        if self.stopped:
            return ""
        for token in ids:
            self.ids.append(token)
            piece = self._decoder.step(self._tokenizer, token) or ""
            self.token_texts.append(piece)
            self._held += piece
        return self._release(final=False)

    def finish(self) -> str:
        """No more ids: emit whatever is held, bytes that never completed a character included."""
        if not self.stopped:
            whole = self._tokenizer.decode(self.ids, skip_special_tokens=True)
            seen = self.text + self._held
            if whole.startswith(seen):
                self._held += whole[len(seen) :]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        cut = self._stop_index()
        if cut is not None:
            emit = self._held[:cut]
            self._held = ""
            self.stopped = True
        elif final or not self._stops:
            emit, self._held = self._held, ""
        else:
            keep = self._stop_prefix_len()
            emit = self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
        self.text += emit
        return emit

    def _stop_index(self) -> int | None:
        """Where, within the held text, the earliest stop string begins (None if nowhere)."""
        if not self._stops:
            return None
        # A stop string may straddle emitted and held text only if emitted text could not
        # have contained its start: we hold back any such prefix, so searching the held text
        # together with nothing emitted is enough.
        hits = [i for s in self._stops if (i := self._held.find(s)) >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest held suffix that is a proper prefix of some stop string."""
        longest = 0
        for n in range(1, min(self._longest_stop, len(self._held) + 1)):
            tail = self._held[-n:]
            if any(s.startswith(tail) for s in self._stops):
                longest = n
        return longest
