"""The worker's side of a plan change, through its real internal endpoints: one in-process
agent serving the tiny model (2 layers), and a member holding a certificate and the key of the
cluster that sends it signed orders (stage, commit, abort, unload) and steps on the data plane,
as an orchestrator does. Orders are made from the one the worker serves (`dataclasses.replace`).
The agent is shared by the module's tests; after each one it serves the first route again.

- an order of an older epoch than the newest one obeyed is refused as stale (409), whatever it is;
- a staged order answers steps but is not served until committed; an aborted one leaves the
  served order serving, and cannot be committed any more;
- a commit switches the served order (its fragments), the replaced one answers steps a while;
- a step of a plan (or epoch) the worker does not know is ``stale_plan``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.cluster.peer_client import PeerClient, PeerError
from agent.core.orders import RoutingOrder
from agent.core.plan import LayerRange
from agent.core.protocol import ABORT_PATH, COMMIT_PATH, ROUTING_PATH, UNLOAD_PATH, CloseFrame, StepFrame
from agent.core.routing import Hop, Route
from agent.dataplane.links import Links, StageError
from agent.http.app_keys import RESULTS, WORKER
from agent.local.compat import timeout
from tests.agent.agents import CLUSTER_KEY, member_tls
from tests.agent.inprocess import LocalAgent, share_calibration
from tests.agent.tiny import TINY, tiny_cluster

PROMPT = np.asarray([[5, 6, 7]], dtype=np.int64)


class Member:
    """Signed calls to one agent's internal endpoints, as a member of the cluster makes them."""

    def __init__(self, agent: LocalAgent, client: PeerClient) -> None:
        self.agent = agent
        self.client = client
        self.links = Links(client)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """(status, answer): the agent's signed answer, or its error."""
        try:
            return 200, await self.client.request_json("POST", self.agent.peer_url, path, body,
                                                       target=self.agent.node_id, timeout_s=30)
        except PeerError as error:
            assert error.status is not None, error  # an answer, not a lost connection
            return error.status, error.peer_answer

    async def stage(self, order: RoutingOrder) -> tuple[int, Any]:
        return await self.post(ROUTING_PATH, order.to_json())

    async def commit(self, order: RoutingOrder, epoch: int | None = None) -> tuple[int, Any]:
        return await self.post(COMMIT_PATH, {"name": order.name, "plan_version": order.plan_version,
                                             "epoch": order.epoch if epoch is None else epoch})

    async def abort(self, order: RoutingOrder, epoch: int | None = None) -> tuple[int, Any]:
        return await self.post(ABORT_PATH, {"name": order.name, "plan_version": order.plan_version,
                                            "epoch": order.epoch if epoch is None else epoch})

    async def step(self, order: RoutingOrder, sid: str, *, plan: int | None = None, epoch: int | None = None,
                   layer: int = 0, **fields: Any) -> dict[str, Any]:
        """The result (or error) frame of a first step of session ``sid`` sent on the data plane,
        naming the agent itself as its reply node (a member has no data plane of its own);
        ``fields`` go into the step's header as they are."""
        header = {"kind": "step", "sid": sid, "seq": 0, "layer": layer, "start": 0,
                  "epoch": order.epoch if epoch is None else epoch,
                  "plan": order.plan_version if plan is None else plan, "sample": True, "params": {"temperature": 0},
                  "reply": self.agent.node_id, "reply_url": self.agent.peer_url, **fields}
        outcome = self.agent.app[RESULTS].expect(sid, 0)
        link = await self.links.get(self.agent.node_id, self.agent.peer_url)
        await link.post(header, PROMPT)
        try:
            async with timeout(30):
                return (await outcome).header()
        except StageError as error:
            return error.frame(StepFrame.from_header(header)).header()

    async def close_session(self, sid: str, order: RoutingOrder) -> None:
        link = await self.links.get(self.agent.node_id, self.agent.peer_url)
        await link.send(CloseFrame(sid, 0, order.plan_version).header())


Scenario = Callable[[LocalAgent, "Member"], Awaitable[None]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One agent for the module (a start is most of a test's time): (run, its first order), where
    ``run(scenario)`` runs ``scenario(agent, member)`` in the agent's event loop."""
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    tmp = tmp_path_factory.mktemp("worker-orders")

    async def start() -> tuple[LocalAgent, Member]:
        agent, _ = await stack.enter_async_context(tiny_cluster(tmp, 1))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        member = Member(agent, PeerClient(session, CLUSTER_KEY.encode(), "tester", member_tls(tmp / "tester-tls")))
        stack.push_async_callback(member.links.close)
        return agent, member

    with pytest.MonkeyPatch.context() as monkeypatch:
        share_calibration(monkeypatch)
        try:
            agent, member = loop.run_until_complete(start())
            yield lambda scenario: loop.run_until_complete(scenario(agent, member)), served(agent)
        finally:
            loop.run_until_complete(stack.aclose())
            loop.close()


@pytest.fixture
def run(cluster) -> Iterator[Callable[[Scenario], None]]:
    """Run a test's scenario; afterwards the worker serves the first order's route again (in the
    newest epoch it obeyed, as a new plan), whatever the test left staged or served."""
    run, first = cluster
    yield run

    async def restore(agent: LocalAgent, member: Member) -> None:
        report = agent.app[WORKER].status()
        newest = max([first.plan_version, *(o["plan_version"] for o in report["orders"]),
                      *(s["plan_version"] for s in report["staged"].values())])
        again = replace(first, epoch=report["epoch"], plan_version=newest + 1)
        assert (await member.stage(again))[0] == 200 and (await member.commit(again))[0] == 200

    run(restore)


def served(agent: LocalAgent) -> RoutingOrder:
    """The order the worker serves for the tiny model, as it reports it."""
    orders = [RoutingOrder.from_json(o) for o in agent.app[WORKER].status()["orders"]]
    mine = [o for o in orders if o.name == TINY]
    assert len(mine) == 1, f"the worker serves {len(mine)} orders of {TINY}"
    return mine[0]


def fragments(agent: LocalAgent) -> list[list[int]]:
    return [f["layers"] for f in agent.app[WORKER].status()["models"][TINY]["fragments"]]


def token_of(result: dict[str, Any]) -> int:
    assert result["kind"] == "result", result
    return result["token"]


def sid() -> str:
    return uuid.uuid4().hex


def test_an_order_of_an_older_epoch_is_refused_as_stale(run):
    async def scenario(agent: LocalAgent, member: Member) -> None:
        first = served(agent)
        # a newer orchestrator (the next epoch) is obeyed ...
        newer = replace(first, epoch=first.epoch + 1, orchestrator="tester", plan_version=first.plan_version + 1)
        status, answer = await member.stage(newer)
        assert status == 200 and answer["staged"][TINY]["plan_version"] == newer.plan_version, answer
        assert answer["epoch"] == newer.epoch
        assert (await member.commit(newer))[0] == 200
        assert served(agent) == newer

        # ... and from then on every order of the older epoch is stale, even of a newer plan
        older = replace(first, plan_version=newer.plan_version + 1)
        expected = f"order from epoch {first.epoch} ignored: epoch {newer.epoch} is current"
        for status, answer in (await member.stage(older), await member.commit(older),
                               await member.abort(newer, epoch=first.epoch),
                               await member.post(UNLOAD_PATH, {"name": TINY, "epoch": first.epoch})):
            assert status == 409 and expected in answer["error"], (status, answer)
        report = agent.app[WORKER].status()
        assert served(agent) == newer and report["staged"] == {} and report["epoch"] == newer.epoch
        assert isinstance(token_of(await member.step(newer, sid())), int)  # it serves the order it obeyed

        # in the current epoch, a plan older than the one served is stale too
        status, answer = await member.stage(replace(newer, plan_version=first.plan_version))
        assert status == 409 and f"plan {first.plan_version} is older than plan {newer.plan_version}" \
            in answer["error"], answer

    run(scenario)


def test_a_staged_then_aborted_plan_leaves_the_served_plan_serving(run):
    async def scenario(agent: LocalAgent, member: Member) -> None:
        first = served(agent)
        staged = replace(first, plan_version=first.plan_version + 1)
        status, answer = await member.stage(staged)
        assert status == 200 and set(answer["staged"]) == {TINY}, answer
        assert answer["staged"][TINY]["plan_version"] == staged.plan_version
        assert answer["plan_version"] == first.plan_version and served(agent) == first  # not served yet
        # both answer steps meanwhile, with the same token
        one = token_of(await member.step(first, sid()))
        open_on_staged = sid()
        assert token_of(await member.step(staged, open_on_staged)) == one

        status, answer = await member.abort(staged)
        assert status == 200 and answer["staged"] == {} and answer["plan_version"] == first.plan_version
        assert served(agent) == first and fragments(agent) == [[0, 1]]
        status, answer = await member.commit(staged)  # an aborted plan cannot be committed
        assert status == 409 and f"plan {staged.plan_version} of {TINY} is not staged here" in answer["error"]
        assert served(agent) == first

        # once its last session is closed the aborted plan is gone; the served one goes on
        await member.close_session(open_on_staged, staged)
        gone = await member.step(staged, sid())
        assert gone["kind"] == "error" and gone["code"] == "stale_plan", gone
        assert token_of(await member.step(first, sid())) == one

    run(scenario)


def test_a_commit_switches_the_served_plan_and_the_replaced_one_finishes_its_steps(run):
    async def scenario(agent: LocalAgent, member: Member) -> None:
        first = served(agent)
        assert fragments(agent) == [[0, 1]]
        one = token_of(await member.step(first, sid()))
        # the same layers in two hops on this node: other fragments, the same computation
        split = replace(first, plan_version=first.plan_version + 1, route=Route((
            Hop(agent.node_id, LayerRange(0, 0)), Hop(agent.node_id, LayerRange(1, 1)))))
        assert (await member.stage(split))[0] == 200
        assert served(agent) == first and fragments(agent) == [[0, 1]]

        status, answer = await member.commit(split)
        assert status == 200 and answer["plan_version"] == split.plan_version and answer["staged"] == {}
        assert served(agent) == split and fragments(agent) == [[0, 0], [1, 1]]
        assert token_of(await member.step(split, sid())) == one
        assert token_of(await member.step(first, sid())) == one  # the replaced plan, for steps under way
        assert (await member.commit(split))[0] == 200  # a commit sent twice changes nothing
        assert served(agent) == split

    run(scenario)


def test_a_step_of_a_plan_the_worker_does_not_know_is_stale_plan(run):
    async def scenario(agent: LocalAgent, member: Member) -> None:
        order = served(agent)
        for wrong in ({"plan": order.plan_version + 7}, {"epoch": order.epoch + 1}):
            error = await member.step(order, sid(), **wrong)
            assert error["kind"] == "error" and error["code"] == "stale_plan", error
            assert error["node"] is None  # the caller's fault, not the stage's
            assert f"does not know plan {wrong.get('plan', order.plan_version)}" in error["message"]
        error = await member.step(order, sid(), layer=1)  # no hop of this plan starts there
        assert error["kind"] == "error" and error["code"] == "wrong_stage", error
        assert isinstance(token_of(await member.step(order, sid())), int)  # the link and the worker serve on

    run(scenario)


def test_a_step_that_drafts_tokens_is_verified_and_refused_with_log_probabilities(run):
    async def scenario(agent: LocalAgent, member: Member) -> None:
        order = served(agent)
        plain = token_of(await member.step(order, sid()))
        verified = await member.step(order, sid(), draft=[6, 7])  # the prompt's last token, then two drafted
        assert verified["kind"] == "result" and len(verified.get("more", [])) <= 2, verified
        error = await member.step(order, sid(), draft=[6, 7], params={"temperature": 0, "logprobs": 2})
        assert error["kind"] == "error" and error["code"] == "bad_request" and error["node"] is None, error
        assert "log-probabilities" in error["message"]
        assert token_of(await member.step(order, sid())) == plain  # the worker serves on

    run(scenario)
