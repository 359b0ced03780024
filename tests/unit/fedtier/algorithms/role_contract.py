"""The contract every algorithm's roles honour (STYLE: "Role contract suite").

Subclass ``RoleContract`` in an algorithm's test module and implement ``hierarchy()``:
the suite then checks duplicates, wrong rounds, unknown senders, late messages, quorum and
deadline handling, catch-up resends and the ERROR state against that algorithm.
"""

from __future__ import annotations

import numpy as np
import pytest
from hierarchy import Hierarchy

from fedtier.algorithms.base import Dropped, RoleState
from fedtier.errors import (
    LateMessageError,
    LayoutMismatchError,
    LocalProtocolError,
    UnknownSenderError,
    WrongRoundError,
)
from fedtier.wire.messages import CellTask, CellUpdate, DeviceUpdate, Message


class RoleContract:
    """Abstract: subclasses provide ``hierarchy(**kw) -> Hierarchy`` and ``update(...)``."""

    def hierarchy(self, **kwargs: object) -> Hierarchy:
        raise NotImplementedError

    def device_update(self, h: Hierarchy, device: str, round: int, scale: float = 1.0,
                      tensors: dict | None = None) -> Message:
        """A valid first upload of ``device`` in ``round`` (algorithms with another first upload override)."""
        return DeviceUpdate(rollout="r", round=round, sender=device,
                            delta=tensors or {n: np.full_like(p, scale) for n, p in h.params.items()},
                            num_samples=10, train_loss=0.5, steps=1)

    def cell_update(self, h: Hierarchy, cell: str, round: int) -> Message:
        """A cell's upload of ``round`` with no change (algorithms with another cell upload override)."""
        return CellUpdate(rollout="r", round=round, sender=cell,
                          delta={n: np.zeros_like(p) for n, p in h.params.items()}, weight=1.0)

    # --- a whole rollout runs --------------------------------------------------------------------

    def test_all_rounds_close_and_finish(self) -> None:
        h = self.hierarchy(rounds=3)
        h.run()
        assert [c.round for c in h.closed] == [0, 1, 2]
        assert h.finished and h.cloud.state is RoleState.FINISHED

    # --- duplicates -------------------------------------------------------------------------------

    def test_duplicate_task_is_dropped_not_retrained(self) -> None:
        h = self.hierarchy(rounds=2)
        h.offline = set(h.devices)  # keep round 0 open: no device answers
        h.start()
        cell = next(iter(h.cells))
        task = h.received[cell][-1]
        actions = h.edges[cell].receive(task, h.now)
        assert [type(a) for a in actions] == [Dropped] and actions[0].reason == "duplicate"

    def test_duplicate_update_is_dropped_and_counted_once(self) -> None:
        h = self.hierarchy(rounds=1)
        h.offline = set(h.devices)
        h.start()
        cell, members = next(iter(h.cells.items()))
        upd = self.device_update(h, members[0], 0)
        assert h.edges[cell].receive(upd, 0.0) == []
        again = h.edges[cell].receive(upd, 0.0)
        assert [a.reason for a in again if isinstance(a, Dropped)] == ["duplicate"]
        assert h.edges[cell].reported == (members[0],)

    # --- remote errors leave the role usable ------------------------------------------------------

    def test_update_for_a_future_round_raises_wrong_round(self) -> None:
        h = self.hierarchy(rounds=2)
        h.offline = set(h.devices)
        h.start()
        cell, members = next(iter(h.cells.items()))
        with pytest.raises(WrongRoundError):
            h.edges[cell].receive(self.device_update(h, members[0], 5), 0.0)
        assert h.edges[cell].state is RoleState.COLLECTING

    def test_update_from_a_non_member_raises_unknown_sender(self) -> None:
        h = self.hierarchy(rounds=1)
        h.offline = set(h.devices)
        h.start()
        cell = next(iter(h.cells))
        with pytest.raises(UnknownSenderError):
            h.edges[cell].receive(self.device_update(h, "dev-99", 0), 0.0)

    def test_update_with_wrong_tensors_raises_layout_mismatch(self) -> None:
        h = self.hierarchy(rounds=1)
        h.offline = set(h.devices)
        h.start()
        cell, members = next(iter(h.cells.items()))
        bad = self.device_update(h, members[0], 0, tensors={"other": np.zeros(3, np.float32)})
        with pytest.raises(LayoutMismatchError):
            h.edges[cell].receive(bad, 0.0)

    def test_late_update_after_close_raises_late(self) -> None:
        h = self.hierarchy(rounds=2)
        h.run()  # both rounds closed with every device
        cell, members = next(iter(h.cells.items()))
        with pytest.raises(LateMessageError):
            h.edges[cell].receive(self.device_update(h, members[0], 0), 99.0)

    def test_stale_task_raises_wrong_round(self) -> None:
        h = self.hierarchy(rounds=2)
        h.run()
        cell = next(iter(h.cells))
        old = next(m for m in h.received[cell] if isinstance(m, CellTask) and m.round == 0)
        with pytest.raises(WrongRoundError):
            h.edges[cell].receive(old, 99.0)

    def test_cloud_rejects_unknown_cell(self) -> None:
        h = self.hierarchy(rounds=1)
        h.offline = set(h.devices)
        h.start()
        update = self.cell_update(h, "cell-zz", 0)
        with pytest.raises(UnknownSenderError):
            h.cloud.receive(update, 0.0)
        assert h.cloud.state is RoleState.COLLECTING

    # --- quorum and deadline -------------------------------------------------------------------------

    def test_round_waits_for_all_then_quorum_after_deadline(self) -> None:
        h = self.hierarchy(rounds=1, quorum=0.5, deadline_s=10.0)
        straggler = sorted(h.devices)[-1]
        h.offline = {straggler}
        h.start()
        assert h.closed == []  # everyone else reported, but the straggler's cell waits
        h.tick(5.0)
        assert h.closed == []  # before the deadline nothing closes
        for k in range(1, 50):  # each step of a multi-step round has its own deadline
            h.tick(10.5 * k)
            if h.closed:
                break
        assert len(h.closed) == 1
        assert straggler in h.closed[0].missing

    def test_no_quorum_keeps_round_open(self) -> None:
        h = self.hierarchy(rounds=1, quorum=1.0, deadline_s=1.0)
        h.offline = {sorted(h.devices)[0]}
        h.start()
        h.tick(100.0)
        assert h.closed == [] and h.cloud.state is RoleState.COLLECTING

    def test_device_coming_online_gets_the_open_task(self) -> None:
        h = self.hierarchy(rounds=1)
        late = sorted(h.devices)[0]
        h.offline = {late}
        h.start()
        assert h.closed == []
        h.reconnect(late)
        assert len(h.closed) == 1 and h.closed[0].missing == ()

    def test_device_restarted_after_an_upload_does_not_upload_that_step_again(self) -> None:
        # A second upload of a step would be a second noisy release that the ledger never charges.
        reference = self.hierarchy(rounds=1)
        reference.run()
        h = self.hierarchy(rounds=1)
        victim = sorted(h.devices)[0]
        cell = h.devices[victim].cell
        held: list[Message] = []
        deliver = h.deliver_to_edge

        def hold_first_upload(to: str, msg: Message) -> None:
            if msg.sender == victim and not held:
                held.append(msg)  # in the outbox / in flight when the agent dies
                return
            deliver(to, msg)

        h.deliver_to_edge = hold_first_upload  # type: ignore[method-assign]
        h.start()
        assert len(held) == 1 and h.closed == []
        h.restart_device(victim, last_sent=(held[0].round, held[0].step))
        h.reconnect(victim)  # the edge resends the open task: the victim owes this step
        deliver(cell, held[0])  # the outbox's resend arrives
        uploads = [m for m in h.received[cell] if m.sender == victim and (m.round, m.step) == (0, held[0].step)]
        assert len(uploads) == 1
        assert len(h.closed) == 1 and h.closed[0].missing == ()
        for name, value in reference.closed[0].params.items():
            np.testing.assert_array_equal(h.closed[0].params[name], value)

    # --- local misuse -----------------------------------------------------------------------------

    def test_trained_without_request_moves_device_to_error(self) -> None:
        from fedtier.algorithms.base import LocalResult

        h = self.hierarchy(rounds=1)
        device = h.devices[sorted(h.devices)[0]]
        with pytest.raises(LocalProtocolError):
            device.trained(0, LocalResult(delta={}, num_samples=1, mean_loss=0.0, steps=1))
        assert device.state is RoleState.ERROR
        with pytest.raises(LocalProtocolError):
            device.tick(0.0)

    def test_cloud_start_twice_is_misuse(self) -> None:
        h = self.hierarchy(rounds=1)
        h.offline = set(h.devices)
        h.start()
        with pytest.raises(LocalProtocolError):
            h.cloud.start(0.0)
        assert h.cloud.state is RoleState.ERROR
