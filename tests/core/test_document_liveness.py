"""The document-liveness eviction policy: its model recovers how documents come back, and
the queue evicts by that — dead-looking documents and question tails first."""

from __future__ import annotations

import heapq
import math
import random
import statistics
from array import array

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheBlock, Request
from prefixcache.core.eviction.document_liveness import DocumentLivenessFreeBlockQueue
from prefixcache.core.eviction.document_liveness_model import (
    KEPT_TAIL_HASHES,
    MIN_ENDED_WAITS,
    DocumentHistory,
    DocumentLivenessModel,
    logit,
)
from prefixcache.core.eviction.scored import GroupedScoredFreeBlockQueue
from prefixcache.core.request import RequestStatus
from tests.core.helpers import free_ids, make_manager, schedule_prefill, seq
from tests.core.reference_document_liveness import (
    OneHeapDocumentLivenessQueue,
    PlainLoopModel,
)

BLOCK_SIZE = 4


def make_liveness_manager(num_blocks: int = 400):
    return make_manager(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                        eviction_policy="document-liveness")


def queue_of(mgr) -> DocumentLivenessFreeBlockQueue:
    queue = mgr.block_pool.free_block_queue
    assert isinstance(queue, DocumentLivenessFreeBlockQueue)
    return queue


def run_request(mgr, request_id: str, prompt: list[int], num_output_tokens: int = 1,
                status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> list[int]:
    """Prefill, generate ``num_output_tokens`` (slots allocated), end with ``status``, free;
    returns the ids of the prompt's full blocks."""
    request = Request(request_id, prompt)
    _, new_ids = schedule_prefill(mgr, request)
    assert new_ids is not None
    prompt_block_ids = [b.block_id for b in mgr.req_to_blocks[request_id]]
    prompt_block_ids = prompt_block_ids[:len(prompt) // BLOCK_SIZE]
    request.append_output_token_ids([7] * num_output_tokens)
    assert mgr.allocate_slots(request, num_output_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = status
    mgr.free(request)
    return prompt_block_ids


def simulate_documents(model: DocumentLivenessModel, rng: random.Random,
                       continuation: dict[int, float], num_documents: int) -> dict:
    """Play the arrival model the policy assumes: documents of two kinds (by tokens their
    first request generates), each asked again with probability ``continuation[kind]``
    after every request; every step, one unfinished document, chosen uniformly, has its
    next request. Returns, per kind, the state ids of first requests."""
    kinds = [kind for kind in continuation for _ in range(num_documents // 2)]
    documents = [DocumentHistory(prompt_tokens=1000, output_tokens=kind) for kind in kinds]
    unfinished = list(range(len(documents)))
    first_states: dict[int, list[int]] = {kind: [] for kind in continuation}
    while unfinished:
        index = rng.choice(unfinished)
        document = documents[index]
        document.num_requests += 1
        model.tick()
        document.state_id = model.new_state(document)
        if document.num_requests == 1:
            first_states[kinds[index]].append(document.state_id)
        if rng.random() >= continuation[kinds[index]]:
            unfinished.remove(index)
    return first_states


def test_the_model_recovers_how_likely_each_kind_of_document_is_to_come_back():
    model = DocumentLivenessModel()
    first_states = simulate_documents(model, random.Random(0), {3: 0.85, 300: 0.2}, 400)
    often = model.class_probability(model.finest_class(first_states[3][-1]))
    rarely = model.class_probability(model.finest_class(first_states[300][-1]))
    assert 0.7 < often < 0.95
    assert 0.08 < rarely < 0.35
    assert len(model._state_start) == model.now  # one state per request
    # The request rate per live document: 1 / (documents still unfinished) at the end,
    # which is much larger than at the start, when all 400 were.
    assert model.rate > 3 / 400


def play_bursty_documents(model: DocumentLivenessModel, rng: random.Random,
                          num_requests: int) -> list[int]:
    """Traffic unlike one rate: a document is asked again with probability 0.9, after 3
    requests 4 times in 5 and after 300 otherwise; a new document comes whenever none is
    due. Returns the waits of the requests that came (counted in requests)."""
    due: list[tuple[int, int]] = []  # (time of its next request, document index)
    documents: list[DocumentHistory] = []
    last_request: list[int] = []
    waits = []
    for now in range(1, num_requests + 1):
        if due and due[0][0] <= now:
            index = heapq.heappop(due)[1]
            waits.append(now - last_request[index])
        else:
            index = len(documents)
            documents.append(DocumentHistory(prompt_tokens=1000, output_tokens=10))
            last_request.append(0)
        document = documents[index]
        document.num_requests += 1
        last_request[index] = now
        model.tick()
        document.state_id = model.new_state(document)
        if rng.random() < 0.9:
            heapq.heappush(due, (now + (3 if rng.random() < 0.8 else 300), index))
    return waits


def test_the_clock_runs_faster_than_the_fitted_rate_by_the_waits_shape():
    model = DocumentLivenessModel()
    waits = play_bursty_documents(model, random.Random(2), 2000)  # fitted last at 2,000
    # The shape of the waits that ended, computed from the traffic itself: far from an
    # exponential's (median = ln 2 x mean), so the clock runs several times the rate.
    shape = math.log(2) * statistics.fmean(waits) / statistics.median(waits)
    assert shape > 5
    assert model.wait_shape == pytest.approx(shape)
    clock = model.clock
    model.tick()
    assert model.clock - clock == pytest.approx(model.rate * shape)

    one_rate = DocumentLivenessModel(follow_wait_shape=False)
    play_bursty_documents(one_rate, random.Random(2), 2000)
    assert one_rate.wait_shape == 1.0
    assert one_rate.rate == pytest.approx(model.rate)  # the fit itself is the same
    clock = one_rate.clock
    one_rate.tick()
    assert one_rate.clock - clock == pytest.approx(one_rate.rate)


def test_the_clock_keeps_the_fitted_rate_when_waits_have_one_rate():
    # 50 documents live at any time; each step one of them, chosen uniformly, is asked
    # again, and then ends with probability 0.2 (a new one takes its place): every wait
    # is geometric with mean 50, one rate's shape, so the clock keeps the fitted rate.
    model = DocumentLivenessModel()
    rng = random.Random(4)
    live = [DocumentHistory(prompt_tokens=1000, output_tokens=10) for _ in range(50)]
    for _ in range(3000):
        index = rng.randrange(len(live))
        document = live[index]
        document.num_requests += 1
        model.tick()
        document.state_id = model.new_state(document)
        if rng.random() < 0.2:
            live[index] = DocumentHistory(prompt_tokens=1000, output_tokens=10)
    assert 1.0 <= model.wait_shape < 1.15


def test_the_clock_follows_the_fitted_rate_until_enough_waits_have_ended():
    model = DocumentLivenessModel(refit_every=5)
    # As many requests as the waits needed: the first has no wait before it.
    waits = play_bursty_documents(model, random.Random(3), MIN_ENDED_WAITS)
    assert model.num_fits > 0 and 0 < len(waits) < MIN_ENDED_WAITS
    assert model.wait_shape == 1.0
    play_bursty_documents(model, random.Random(3), 1000)  # long waits end too
    assert model.wait_shape > 1.0


def python_fit_model(**knobs) -> DocumentLivenessModel:
    """The model with its fit in Python even where the C one is built."""
    model = DocumentLivenessModel(**knobs)
    model.native_fit = None
    return model


#: Every way the fit is computed, each held to the plain loops: in Python and in C.
FITS = [pytest.param(python_fit_model, id="python"),
        pytest.param(DocumentLivenessModel, id="c", marks=pytest.mark.skipif(
            DocumentLivenessModel.native_fit is None, reason="the package was built without "
            "a C compiler (test_native_extensions.py says whether that is expected)"))]


@pytest.mark.parametrize("make_model", FITS)
@pytest.mark.parametrize("seed", range(4))
def test_the_fit_gives_exactly_what_plain_loops_give(seed, make_model):
    """Documents of several kinds asked about at random, with states cut back, bins of
    several widths and refits every few requests: every estimate equal to the last bit."""
    rng = random.Random(seed)
    knobs = {"max_states": rng.choice([40, 5_000]), "refit_every": rng.choice([3, 25]),
             "hazard_bin": rng.choice([7, 200])}
    models = [make_model(**knobs), PlainLoopModel(**knobs)]
    documents: list[list[DocumentHistory]] = [[], []]
    for _ in range(1500):
        index = rng.randrange(len(documents[0])) if documents[0] and rng.random() < 0.6 else None
        output_tokens, prompt_tokens = rng.choice([1, 5, 50, 600]), rng.randrange(100, 5000)
        for model, kept in zip(models, documents, strict=True):
            if index is None:
                document = DocumentHistory(prompt_tokens, output_tokens)
                kept.append(document)
            else:
                document = kept[index]
                document.min_prompt_tokens = min(document.min_prompt_tokens, prompt_tokens)
                document.max_prompt_tokens = max(document.max_prompt_tokens, prompt_tokens)
            document.num_requests += 1
            model.tick()
            document.state_id = model.new_state(document)
    fast, plain = models
    assert fast.num_fits == plain.num_fits >= 60
    assert fast._leaf_p == plain._leaf_p and fast._bin_rates == plain._bin_rates
    assert (fast.rate, fast.overall_p, fast.clock) == (plain.rate, plain.overall_p,
                                                       plain.clock)


@pytest.mark.parametrize("max_states", [800, 5_000])
def test_the_waits_kept_in_order_give_the_shape_all_kept_waits_give(max_states):
    """Waits far from one rate, and states cut back (their waits leave with them): after
    every fit the shape, and so the clock, equal the ones from every kept state's wait."""
    knobs = {"max_states": max_states, "refit_every": 5}
    kept_in_order, from_scratch = DocumentLivenessModel(**knobs), PlainLoopModel(**knobs)
    shapes = []
    for model in (kept_in_order, from_scratch):
        original = model._adopt_fit

        def adopt_and_note(*fit, model=model, original=original):
            original(*fit)
            shapes.append((model, model.wait_shape, model.clock))

        model._adopt_fit = adopt_and_note
        play_bursty_documents(model, random.Random(5), 1500)
    ours = [(shape, clock) for model, shape, clock in shapes if model is kept_in_order]
    reference = [(shape, clock) for model, shape, clock in shapes if model is from_scratch]
    assert ours == reference and len(ours) == 300
    assert sum(shape > 1.0 for shape, _ in ours) > 100  # the shape does move the clock


@pytest.mark.parametrize("block_size", [1, 16, 512])
def test_what_a_next_request_shares_is_counted_as_block_by_block_lookups_count_it(block_size):
    """Prompts that grow, are cut short, or part from the last one at any block, some
    longer than the tail kept: the shares per depth class equal those of looking every
    tail block up among the new prompt's hashes."""
    rng = random.Random(block_size)
    binary_search, lookups = DocumentLivenessModel(), PlainLoopModel()
    previous = [bytes([7]) * 8]
    for _ in range(400):
        kept = rng.randrange(len(previous) + 1)
        new = previous[:kept] + [rng.randbytes(8)
                                 for _ in range(rng.choice([0, 1, 5, 80]))]
        if not new:
            continue
        for model in (binary_search, lookups):
            model.observe_next_request(len(previous), previous[-KEPT_TAIL_HASHES:], new,
                                       block_size)
        previous = new
    assert binary_search._depth_seen == lookups._depth_seen
    assert binary_search._depth_shared == lookups._depth_shared
    assert sum(lookups._depth_shared) > 2 * len(lookups._depth_shared)  # some were shared


def test_the_model_fits_in_c_wherever_the_c_fit_is_built():
    try:
        from prefixcache.core.eviction._liveness_fit_native import fit
    except ImportError:
        assert DocumentLivenessModel.native_fit is None
    else:
        assert DocumentLivenessModel.native_fit is fit


@pytest.mark.skipif(DocumentLivenessModel.native_fit is None, reason="no C fit built")
@pytest.mark.parametrize("broken", ["classes", "parent", "class id", "list", "int32",
                                    "two-dimensional", "window", "leaves"])
def test_the_c_fit_refuses_inconsistent_inputs_instead_of_reading_past_them(broken):
    fit = DocumentLivenessModel.native_fit
    inputs = {"starts": array("q", [0, 1, 2]), "continued_at": array("q", [1, -1, -1]),
              "classes": (array("q", [0, 0, 0]), array("q", [0, 0, 1]),
                          array("q", [0, 1, 2])),
              "parents": [[-1], [0, 0], [0, 0, 1]], "leaf_p": [0.5, 0.5, 0.5],
              "rates": [0.1], "now": 3, "origin": 0, "width": 200}
    fit(*inputs.values(), 8.0, 0.5, 4)  # consistent: fits
    if broken == "classes":
        inputs["classes"] = tuple(class_ids[:2] for class_ids in inputs["classes"])
    elif broken == "parent":
        inputs["parents"] = [[-1], [0, 5], [0, 0, 1]]
    elif broken == "class id":
        inputs["classes"] = (array("q", [0, 0, 0]), array("q", [0, 0, 1]),
                             array("q", [0, 3, 2]))
    elif broken == "list":
        inputs["starts"] = [0, 1, 2]
    elif broken == "int32":
        inputs["starts"] = array("i", [0, 1, 2])
    elif broken == "two-dimensional":
        inputs["starts"] = memoryview(array("q", [0, 1, 2])).cast("B").cast("q", (3, 1))
    elif broken == "window":
        inputs["origin"] = 1  # the first state starts before it
    else:
        inputs["leaf_p"] = [0.5, 0.5]
    with pytest.raises(ValueError):
        fit(*inputs.values(), 8.0, 0.5, 4)


def test_memory_stays_bounded():
    model = DocumentLivenessModel(max_states=100, refit_every=10)
    simulate_documents(model, random.Random(1), {3: 0.8, 300: 0.3}, 200)
    assert len(model._state_start) <= 100
    assert model._first_state_id > 0
    # States dropped from the window are continued without error; estimates stay sane.
    assert 0.0 < model.overall_p < 1.0

    mgr = make_liveness_manager()
    queue = queue_of(mgr)
    queue.max_documents = 3
    for i in range(6):
        run_request(mgr, f"d{i}", seq(100 * i, 9))
    assert len(queue._documents) == 3


def test_a_full_window_of_states_is_cut_back_to_half():
    model = DocumentLivenessModel(max_states=10, refit_every=1000)
    document = DocumentHistory(prompt_tokens=100, output_tokens=10)
    for _ in range(11):
        document.num_requests += 1
        model.tick()
        document.state_id = model.new_state(document)
    # The eleventh state overflows the ten: the oldest six go, the latest five stay.
    assert len(model._state_start) == 5 and model._first_state_id == 6
    assert document.state_id == 10 and model.finest_class(10) >= 0


def test_a_question_block_goes_before_the_document_it_asks_about():
    # The depth term on its own: with conversations, each question starts one, and its
    # block is judged by whether that conversation goes on (test_conversation_tracker.py).
    mgr = make_manager(num_blocks=400, block_size=BLOCK_SIZE,
                       free_queue_factory=lambda blocks, _: DocumentLivenessFreeBlockQueue(
                           blocks, conversations=False))
    document = seq(0, 12)  # three full blocks
    first = run_request(mgr, "q1", document + seq(500, 4) + [1])
    second = run_request(mgr, "q2", document + seq(600, 4) + [2])
    # The second question shared every block of the first but its question: the model
    # learns that the last block of a prompt is rarely reached by the next request.
    model = queue_of(mgr).model
    last_block, one_before = model.depth_class(0, BLOCK_SIZE), model.depth_class(1, BLOCK_SIZE)
    assert model.log_share_reached(last_block) < model.log_share_reached(one_before)
    cached_order = [i for i in free_ids(mgr) if mgr.block_pool.blocks[i].block_hash]
    question_2, question_1 = second[-1], first[-1]
    document_blocks = second[:3]
    assert document_blocks == first[:3]  # the document was hit, not recomputed
    # Questions first (the newer one is at depth 0 of the better-informed estimate), then
    # the document, deepest block first.
    assert cached_order[:2] == [question_2, question_1]
    assert cached_order[2:5] == list(reversed(document_blocks))


def test_a_kind_of_document_that_never_comes_back_is_evicted_before_one_that_does():
    mgr = make_liveness_manager(num_blocks=2000)
    rng = random.Random(2)
    # Documents whose first answer is short are asked about again; those whose first
    # answer is long never are.
    for i in range(60):
        run_request(mgr, f"long{i}", seq(10_000 + 100 * i, 13), num_output_tokens=300)
        run_request(mgr, f"short{i}", seq(50_000 + 100 * i, 13), num_output_tokens=3)
        if i >= 2:
            j = rng.randrange(i - 2, i)
            run_request(mgr, f"short{j} again {i}", seq(50_000 + 100 * j, 12) + [9, 9],
                        num_output_tokens=3)
    kept = run_request(mgr, "short new", seq(90_000, 13), num_output_tokens=3)
    # Released later, but its kind of document is seldom asked about again.
    dropped = run_request(mgr, "long new", seq(95_000, 13), num_output_tokens=300)
    order = free_ids(mgr)
    assert max(order.index(b) for b in dropped) < min(order.index(b) for b in kept)
    # Under LRU the opposite: the one released last is kept longest.
    lru = make_manager(num_blocks=2000, block_size=BLOCK_SIZE)
    kept_lru = run_request(lru, "short new", seq(90_000, 13), num_output_tokens=3)
    dropped_lru = run_request(lru, "long new", seq(95_000, 13), num_output_tokens=300)
    order = free_ids(lru)
    assert max(order.index(b) for b in kept_lru) < min(order.index(b) for b in dropped_lru)


def test_depth_classes_are_token_distances_so_they_mean_the_same_at_any_block_size():
    model = DocumentLivenessModel()
    assert model.depth_class(0, 16) == model.depth_class(0, 512) == 0
    assert model.depth_class(32, 16) == model.depth_class(1, 512) == (512).bit_length()
    assert model.depth_class(1000, 16) == model.depth_class(4, 512) == model.max_depth_bits


def test_free_blocks_are_rekeyed_when_the_estimates_are_refitted():
    mgr = make_liveness_manager(num_blocks=2000)
    queue = queue_of(mgr)
    early = run_request(mgr, "early", seq(0, 13))  # released before any fit
    model = queue.model
    assert model.num_fits == 0

    key_at_release = queue.free_block_keys()[early[0]]
    for i in range(model.refit_every):  # documents of the same kind that never come back
        run_request(mgr, f"d{i}", seq(1000 * (i + 1), 13))
    assert model.num_fits == 1
    document_class, clock, depth, conversation_class = queue._group_of[early[0]].parts
    # The only conversation of its document: the higher of the two terms.
    refitted = clock + max(
        logit(model.class_probability(document_class)) + model.log_share_reached(depth),
        logit(queue.conversation_model.class_probability(conversation_class)))
    key_now = queue.free_block_keys()[early[0]]
    assert key_now == pytest.approx(refitted)
    assert key_now < key_at_release  # its kind has proved not to come back


def test_a_preempted_release_is_not_a_request():
    mgr = make_liveness_manager()
    queue = queue_of(mgr)
    run_request(mgr, "p", seq(0, 9), status=RequestStatus.PREEMPTED)
    assert queue.model.now == 0 and not queue._documents
    run_request(mgr, "p", seq(0, 9))
    assert queue.model.now == 1 and len(queue._documents) == 1


def test_empty_blocks_always_come_first_and_a_reset_empties_every_key():
    mgr = make_liveness_manager(num_blocks=20)
    run_request(mgr, "a", seq(0, 9))  # 2 cached blocks, a partial one
    queue = queue_of(mgr)
    keys = queue.free_block_keys()
    cached = [i for i in free_ids(mgr) if mgr.block_pool.blocks[i].block_hash is not None]
    assert len(cached) == 2 and free_ids(mgr)[-2:] == cached
    assert all(keys[i] is not None for i in cached)
    assert sum(key is None for key in keys.values()) == 18
    assert mgr.reset_prefix_cache()
    assert all(key is None for key in queue.free_block_keys().values())
    assert queue.num_free_blocks == 20 and free_ids(mgr)[-2:] == cached


@pytest.mark.parametrize("max_states", [8, 20_000])
def test_random_workloads_keep_the_queue_exact(max_states):
    mgr = make_liveness_manager(num_blocks=24)
    queue = queue_of(mgr)
    queue.model = DocumentLivenessModel(max_states=max_states, refit_every=5)
    rng = random.Random(max_states)
    for i in range(300):
        start = 100 * rng.randrange(12)
        prompt = seq(start, rng.randrange(1, 20)) + [rng.randrange(10_000)]
        request = Request(str(i), prompt)
        if schedule_prefill(mgr, request)[1] is None:
            continue
        request.status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.PREEMPTED])
        mgr.free(request)
        free = queue.get_all_free_blocks()
        assert len(free) == queue.num_free_blocks == 24
        assert len({b.block_id for b in free}) == 24


def test_the_lists_evict_in_exactly_the_order_of_one_heap_rekeyed_whole(monkeypatch):
    """Documents asked about again and again, under a pool small enough to evict at
    most requests, refits every 5 requests, preempted releases and a reset: the lists
    keep the same free blocks in the same order, with the same keys, as one heap of
    every group re-keyed whole."""
    managers = [make_liveness_manager(num_blocks=60)]
    monkeypatch.setitem(EVICTION_POLICIES, "document-liveness",
                        OneHeapDocumentLivenessQueue)
    managers.append(make_liveness_manager(num_blocks=60))
    for mgr in managers:
        queue_of(mgr).model = DocumentLivenessModel(refit_every=5)
    rng = random.Random(7)
    num_hit_tokens = [0, 0]
    num_with_lists = 0
    for i in range(600):
        document = rng.randrange(30)
        prompt = (seq(1000 * document, 4 * rng.randrange(2, 6))
                  + seq(10_000 + 100 * i, rng.randrange(1, 9)))
        status = (RequestStatus.PREEMPTED if rng.random() < 0.1
                  else RequestStatus.FINISHED_STOPPED)
        num_output_tokens = rng.choice([1, 2, 5, 30])
        for index, mgr in enumerate(managers):
            request = Request(str(i), prompt)
            num_hit, new_ids = schedule_prefill(mgr, request)
            assert new_ids is not None
            num_hit_tokens[index] += num_hit
            request.append_output_token_ids([7] * num_output_tokens)
            assert mgr.allocate_slots(request, num_output_tokens) is not None
            request.num_computed_tokens = request.num_tokens
            request.status = status
            mgr.free(request)
        lists_queue = queue_of(managers[0])
        num_with_lists += bool(lists_queue._lists)
        assert sum(map(len, lists_queue._lists.values())) == lists_queue._num_listed
        assert free_ids(managers[0]) == free_ids(managers[1])
        assert lists_queue.free_block_keys() == queue_of(managers[1]).free_block_keys()
        if i == 300:
            for mgr in managers:
                assert mgr.reset_prefix_cache()
    assert num_hit_tokens[0] == num_hit_tokens[1] > 0
    assert queue_of(managers[0]).model.num_fits > 100 and num_with_lists > 500


def test_a_group_kept_across_a_reset_can_take_blocks_again():
    class OneGroupQueue(GroupedScoredFreeBlockQueue):
        def key_of_parts(self, parts):
            return parts

        def parts_for(self, block):
            return None if block.block_hash is None else 0

    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = OneGroupQueue(blocks)
    a, b = queue.popleft_n(2)
    group = queue._new_group(0)
    a.block_hash = b"a"
    queue._add_to_group(group, a)
    queue.append_n([b])
    a.block_hash = None
    queue._empty_every_block()  # a reset: both empty now, in the same order
    assert queue.get_all_free_blocks() == [b, a]
    taken = queue.popleft_n(2)
    a.block_hash = b"a"
    queue._add_to_group(group, a)
    assert queue.num_free_blocks == 1 and group.num_live == 1
    assert queue.popleft() is a
    assert taken == [b, a]


def test_a_document_keeps_only_its_prompts_last_hashes_yet_counts_every_block():
    mgr = make_liveness_manager(num_blocks=2000)
    queue = queue_of(mgr)
    document = seq(0, 4 * (KEPT_TAIL_HASHES + 20))  # a prompt longer than the kept tail
    run_request(mgr, "q1", document + seq(90_000, 4) + [1])
    (kept,) = queue._documents.values()
    assert kept.num_prompt_blocks == KEPT_TAIL_HASHES + 21
    assert len(kept.prompt_tail_hashes) == KEPT_TAIL_HASHES
    model = queue.model
    seen_before = list(model._depth_seen)
    shared_before = list(model._depth_shared)
    run_request(mgr, "q2", document + seq(91_000, 4) + [2])
    seen = [after - before for after, before in zip(model._depth_seen, seen_before, strict=True)]
    shared = [after - before for after, before in zip(model._depth_shared, shared_before,
                                                                   strict=True)]
    # Every block of the first prompt counted; all but its question shared, the deep
    # ones (before the kept tail) too, since the tail's first block is.
    assert sum(seen) == KEPT_TAIL_HASHES + 21
    assert sum(shared) == KEPT_TAIL_HASHES + 20
    assert shared[0] == 0 and seen[0] == 1


@pytest.mark.parametrize("knobs", [{"max_states": 1}, {"prior_weight": 0.0},
                                   {"refit_every": 0}, {"initial_rate": float("nan")},
                                   {"hazard_bin": 2.5}])
def test_unusable_model_knobs_are_refused(knobs):
    with pytest.raises(ValueError, match=next(iter(knobs))):
        DocumentLivenessModel(**knobs)


def test_content_released_without_a_request_is_keyed_as_an_unknown_documents():
    """The overall log-odds plus the clock at release: not even odds."""
    mgr = make_liveness_manager(num_blocks=8)
    queue = queue_of(mgr)
    queue.model.overall_log_odds = -3.0  # documents rarely come back, as fitted
    queue.model.clock = 2.0
    request = Request("no request told", seq(0, 8))
    assert schedule_prefill(mgr, request)[1] is not None
    blocks = mgr.req_to_blocks["no request told"]
    mgr.block_pool.free_blocks(list(reversed(blocks)))  # released with no request
    keys = queue.free_block_keys()
    assert [keys[block.block_id] for block in blocks] == [-1.0, -1.0]


def test_generated_content_is_keyed_as_the_prompts_deepest_own_block():
    """Blocks beyond the prompt join the group of its last full block: the
    conversation's own content at depth 0, not its document's."""
    mgr = make_liveness_manager()
    queue = queue_of(mgr)
    run_request(mgr, "start", seq(0, 8) + seq(100, 8))  # a conversation on document 0
    run_request(mgr, "other", seq(0, 8) + seq(200, 8))  # another: their blocks are their own
    request = Request("other again", seq(0, 8) + seq(200, 8) + seq(300, 8))
    assert schedule_prefill(mgr, request)[1] is not None
    request.append_output_token_ids([7] * 4)  # fills a seventh block
    assert mgr.allocate_slots(request, 4) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.FINISHED_STOPPED
    blocks = list(mgr.req_to_blocks["other again"])
    mgr.free(request)
    assert len(blocks) == 7 and blocks[6].block_hash is not None
    groups = queue._group_of
    assert groups[blocks[6].block_id] is groups[blocks[5].block_id]
    assert groups[blocks[0].block_id] is not groups[blocks[5].block_id]  # the document's
