"""Retrieval-augmented generation: questions about documents of Zipf popularity."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from prefixcache.sim.workloads.sampling import ZipfChooser, lognormal_tokens
from prefixcache.sim.workloads.synthetic_request import SyntheticRequest


@dataclass(frozen=True, slots=True)
class RAGWorkload:
    """Requests arrive as a Poisson process (``requests_per_s``). Each asks a fresh
    question (``question_tokens``, shared only by its thread's follow-ups) about one of
    ``num_documents`` documents (``document_tokens`` long, log-normal), chosen with Zipf
    popularity of exponent ``zipf_s`` over a random ranking; the prompt is a shared
    instruction prompt (``system_prompt_tokens``), the document, then the question. With
    probability ``follow_up_probability`` the next request is a follow-up instead: the
    previous prompt, its answer and a new question. Every ``popularity_drift_every``
    requests (0: never) the ranking is redrawn, so yesterday's popular documents go cold.
    """

    num_documents: int = 1500
    zipf_s: float = 0.9
    document_tokens: int = 5000
    system_prompt_tokens: int = 400
    question_tokens: int = 80
    output_tokens: int = 200
    follow_up_probability: float = 0.2
    requests_per_s: float = 2.0
    popularity_drift_every: int = 0

    name = "rag"

    def stream(self, num_requests: int, rng: random.Random) -> Iterator[SyntheticRequest]:
        """``num_requests`` requests, in order of arrival, drawn with ``rng`` one at a
        time as they are taken."""
        document_lengths = [lognormal_tokens(rng, self.document_tokens, 0.6, low=256,
                                             high=60_000)
                            for _ in range(self.num_documents)]
        chooser = ZipfChooser(rng, self.num_documents, self.zipf_s)
        now = 0.0
        previous: SyntheticRequest | None = None
        for index in range(num_requests):
            if self.popularity_drift_every and index and index % self.popularity_drift_every == 0:
                chooser.reshuffle()
            now += rng.expovariate(self.requests_per_s)
            question = lognormal_tokens(rng, self.question_tokens, 0.5, low=4)
            answer = lognormal_tokens(rng, self.output_tokens, 0.6, low=1)
            if previous is not None and rng.random() < self.follow_up_probability:
                # The thread's transcript grows by the answer and the new question.
                thread, length = previous.segments[-1]
                segments = (*previous.segments[:-1],
                            (thread, length + previous.output_length + question))
            else:
                document = chooser.draw()
                segments = ((("rag-system", 0), self.system_prompt_tokens),
                            (("rag-document", document), document_lengths[document]),
                            (("rag-thread", index), question))
            previous = SyntheticRequest(int(now * 1000), segments, answer)
            yield previous
