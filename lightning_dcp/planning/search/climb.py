"""THE move engine of the searches: hill climbing over proposed moves, each priced exactly before it is taken.

Every local search in planning runs on :func:`climb`: the layout plan's refinement
(:mod:`~lightning_dcp.planning.search.sample_blocks`), the tree refiner (:mod:`~lightning_dcp.planning.search.refine`)
and the round planner's moves (:mod:`~lightning_dcp.planning.lockstep.moves`). A search gives its state, the score of
a state, the moves it proposes (best estimate first) and an exact ``attempt`` of one move. Every limit is counted
in moves and tries, never in seconds, so every rank plans the same step. Pure Python.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterable, Optional, TypeVar

from lightning_dcp.planning.search.objective import improves

__all__ = ["Attempt", "climb"]

S = TypeVar("S")
M = TypeVar("M")
Attempt = Optional[tuple[Any, Callable[[], Any]]]
"""What an attempt returns: ``(score, take)`` (``take()`` makes the move and returns the new state), or None when the
move is not possible."""


def climb(state: S, score: Callable[[S], Any], moves: Callable[[S], Iterable[M]], attempt: Callable[[S, M], Attempt], *,
          better: Callable[[Any, Any], bool] = improves, width: int | None = None, rounds: int | None = None,
          best_of_round: bool = False, keep_going: bool = False) -> S:
    """Improve ``state`` by moves until none helps.

    Each round looks at the moves ``moves(state)`` proposes (at most ``width``) and takes the first whose attempted
    score is ``better`` than ``score(state)`` (``best_of_round``: the best of them all, each compared with the best so
    far). A round that takes none ends the climb, unless ``keep_going`` (the search then proposes other moves next
    round; an empty proposal always ends it). At most ``rounds`` rounds.
    """
    done = 0
    while rounds is None or done < rounds:
        done += 1
        proposed = list(islice(moves(state), width))
        if not proposed:
            return state
        best, current = None, score(state)
        for move in proposed:
            got = attempt(state, move)
            if got is None or not better(got[0], current if best is None else best[0]):
                continue
            best = got
            if not best_of_round:
                break
        if best is None:
            if keep_going:
                continue
            return state
        state = best[1]()
    return state
