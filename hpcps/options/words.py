"""The user's command-line words, as the commands hpcps prints for them keep them (``hpcps tune``'s
best layouts, ``--paradigm auto``'s paradigms): the options the printed command sets itself, or that only
the tuning reads, left out. Pure: no imports of the rest of hpcps."""

from __future__ import annotations

from typing import Sequence


def without_options(words: Sequence[str], *, one: Sequence[str] = (), many: Sequence[str] = ()) -> list[str]:
    """Command-line ``words`` less the options named, each with its values: one value for those in ``one``
    (``--x V`` or ``--x=V``), every word up to the next option for those in ``many``. What a printed command
    leaves out of the user's own."""
    kept, skip = [], 0  # skip: 1, the next word; 2, every word up to the next option
    for word in words:
        if skip == 1 or (skip == 2 and not word.startswith("-")):
            skip = 0 if skip == 1 else 2
            continue
        skip = 0
        name, inline = word.split("=", 1)[0], "=" in word
        if name in one or name in many:
            skip = 0 if inline else 1 if name in one else 2
            continue
        kept.append(word)
    return kept
