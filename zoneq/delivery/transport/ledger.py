"""What a session has settled so far: one outcome per recipient, filled in as replies come."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zoneq.delivery.results import RecipientResult
from zoneq.delivery.transport.abort import Abort
from zoneq.delivery.transport.options import Recipient
from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict, classify


class Ledger:
    """The recipients of one ``deliver`` call and the outcome of each, once known."""

    def __init__(self, recipients: Sequence[Recipient]) -> None:
        self.recipients = recipients
        self.results: list[RecipientResult | None] = [None] * len(recipients)
        self.transactions = 0  # MAIL transactions begun in this session

    def settle(
        self,
        index: int,
        verdict: Verdict,
        stage: Stage,
        *,
        reply: Reply | None = None,
        status: EnhancedStatus | None = None,
        detail: str = "",
        possible_duplicate: bool = False,
    ) -> None:
        if status is None and reply is not None:
            status = reply.enhanced
        self.results[index] = RecipientResult(
            address=self.recipients[index].address,
            verdict=verdict,
            stage=stage,
            reply=reply,
            status=status,
            detail=detail,
            possible_duplicate=possible_duplicate,
            transaction=max(self.transactions - 1, 0),
        )

    def settle_by_reply(self, indices: Iterable[int], stage: Stage, reply: Reply) -> None:
        verdict = classify(reply, stage)
        for index in indices:
            self.settle(index, verdict, stage, reply=reply)

    def settle_rest(self, abort: Abort) -> None:
        for index, result in enumerate(self.results):
            if result is None:
                self.settle(
                    index,
                    abort.verdict,
                    abort.stage,
                    reply=abort.reply,
                    status=abort.status,
                    detail=abort.detail,
                )

    def forget(self, indices: Iterable[int]) -> None:
        for index in indices:
            self.results[index] = None

    def outcomes(self) -> tuple[RecipientResult, ...]:
        settled = tuple(result for result in self.results if result is not None)
        if len(settled) != len(self.results):  # pragma: no cover - every path settles all
            raise AssertionError("a recipient was left without an outcome")
        return settled
