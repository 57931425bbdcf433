//! Models of the drivers around the sessions. Each applies the session's effects the way a
//! real driver does (`src/receiver`, `src/sender`, `src/transport`) and checks, as it goes,
//! the obligations SPEC.md puts on the session:
//!
//! * receiver: `Fence` at most once per reservation; digests computed only after the fence
//!   completed (fence before verify); `Release` only after the fence completed and while no
//!   digest job reads the pages (fence before release); a write lands only in a page leased
//!   to its own reservation; `Failed` only after `Release`; `Delivered` only for a fenced
//!   reservation whose landed memory digests equal the accepted COMMIT's;
//! * sender: `ReleaseSource` only when no posted write and no digest job of the transfer
//!   remain (drain before release), once per submission; an outcome only after it.

use std::collections::{BTreeMap, BTreeSet};

use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent};
use kvwire_proto::sender::{PageWrite, SenderAction, SenderEvent, WriteOutcome};
use kvwire_proto::wire::TransferId;
use kvwire_proto::wire::{Commit, DigestAlgorithm, TransferDigests, TransferRef};

use crate::digest::{self, Content};
use crate::{ensure, Violation};

/// One receiver pool page.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Page {
    /// The reservation holding the page's lease, if any.
    pub owner: Option<TransferRef>,
    /// What the page holds (pages are not zeroed between uses).
    pub content: Content,
    /// Quarantined: failed, never to be delivered or reused until released.
    pub quarantined: bool,
}

/// A reservation's access scope (loopback/TCP: a scope key; RDMA: a memory window).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AccessScope {
    /// The reserved pages, in ordinal order.
    pub pages: Vec<u32>,
    /// Whether writes under the scope still land.
    pub open: bool,
}

/// How a reservation ended on the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RxOutcome {
    /// Delivered to the engine.
    Delivered,
    /// Failed.
    Failed,
    /// Moved off a failed lane: its pages went on under a new reservation (SPEC §9.2).
    Moved,
}

/// The receiver's driver: pool, scopes, fences, digest jobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RxDriver {
    /// The pool.
    pub pages: Vec<Page>,
    /// Access scopes by reservation (kept after closing, to refuse late writes).
    pub scopes: BTreeMap<TransferRef, AccessScope>,
    /// Fences requested and not yet completed, in request order.
    pub fences: Vec<TransferRef>,
    /// Reservations whose fence completed.
    pub fenced: BTreeSet<TransferRef>,
    /// Digest jobs running: (reservation, algorithm, page digests, aux record).
    pub digest_jobs: Vec<(TransferRef, DigestAlgorithm, bool, Vec<u8>)>,
    /// The digests each job computed over the landed memory.
    pub digested: BTreeMap<TransferRef, TransferDigests>,
    /// Reservations whose pages were released.
    pub released: BTreeSet<TransferRef>,
    /// The terminal event of each reservation.
    pub outcomes: BTreeMap<TransferRef, RxOutcome>,
    /// The COMMIT the session accepted for a reservation (the one it fenced for).
    pub accepted: BTreeMap<TransferRef, Commit>,
    /// Reservations made (the pages of each, as reserved).
    pub reserved: BTreeMap<TransferRef, Vec<u32>>,
    /// Buffers per page index.
    pub buffers: usize,
}

impl RxDriver {
    /// A pool of `pages` free pages.
    pub fn new(pages: usize, buffers: usize) -> Self {
        Self {
            pages: vec![Page::default(); pages],
            scopes: BTreeMap::new(),
            fences: Vec::new(),
            fenced: BTreeSet::new(),
            digest_jobs: Vec::new(),
            digested: BTreeMap::new(),
            released: BTreeSet::new(),
            outcomes: BTreeMap::new(),
            accepted: BTreeMap::new(),
            reserved: BTreeMap::new(),
            buffers,
        }
    }

    /// The lowest `n` free pages, if there are that many.
    pub fn free_pages(&self, n: usize) -> Option<Vec<u32>> {
        let free: Vec<u32> = (0..self.pages.len() as u32)
            .filter(|&p| self.pages[p as usize].owner.is_none())
            .take(n)
            .collect();
        (free.len() == n).then_some(free)
    }

    /// Leases `pages` to a reservation the session accepted and opens its scope.
    pub fn lease(&mut self, transfer: TransferRef, pages: &[u32]) -> Result<(), Violation> {
        for &p in pages {
            let page = &mut self.pages[p as usize];
            ensure!(page.owner.is_none(), "page {p} leased twice");
            page.owner = Some(transfer);
        }
        self.scopes.insert(
            transfer,
            AccessScope {
                pages: pages.to_vec(),
                open: true,
            },
        );
        self.reserved.insert(transfer, pages.to_vec());
        Ok(())
    }

    /// A write for `transfer` reaches this node. Returns whether it landed.
    pub fn land(
        &mut self,
        transfer: TransferRef,
        ordinal: u32,
        dst: u32,
        content: Content,
    ) -> Result<bool, Violation> {
        let Some(scope) = self.scopes.get(&transfer) else {
            return Ok(false);
        };
        if !scope.open || scope.pages.get(ordinal as usize) != Some(&dst) {
            return Ok(false);
        }
        let page = &mut self.pages[dst as usize];
        ensure!(
            page.owner == Some(transfer),
            "a write for {transfer:?} landed in page {dst} held by {:?} (released before the fence?)",
            page.owner
        );
        page.content = content;
        Ok(true)
    }

    /// The contents of a reservation's pages, in ordinal order.
    pub fn contents(&self, transfer: TransferRef) -> Vec<Content> {
        self.reserved
            .get(&transfer)
            .map(|ps| ps.iter().map(|&p| self.pages[p as usize].content).collect())
            .unwrap_or_default()
    }

    /// Applies one effect of the receiver session.
    pub fn apply(&mut self, action: ReceiverAction) -> Result<(), Violation> {
        match action {
            ReceiverAction::Quarantine(t) => {
                ensure!(
                    self.scopes.contains_key(&t),
                    "Quarantine({t:?}) for no reservation"
                );
                ensure!(
                    !self.released.contains(&t),
                    "Quarantine({t:?}) after Release"
                );
                for p in &self.scopes[&t].pages {
                    self.pages[*p as usize].quarantined = true;
                }
            }
            ReceiverAction::Reopen(t) => {
                // Handled by the world, which calls the session back (`reopen_pages`, `moved`).
                return Err(crate::Violation(format!(
                    "Reopen({t:?}) reached the driver model unhandled"
                )));
            }
            ReceiverAction::Fence(t) => {
                ensure!(
                    self.scopes.contains_key(&t),
                    "Fence({t:?}) for no reservation"
                );
                ensure!(
                    !self.fences.contains(&t) && !self.fenced.contains(&t),
                    "Fence({t:?}) emitted twice"
                );
                self.fences.push(t);
            }
            ReceiverAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
                aux,
            } => {
                ensure!(
                    self.fenced.contains(&transfer),
                    "ComputeDigests({transfer:?}) before its fence completed (fence before verify)"
                );
                ensure!(
                    !self.released.contains(&transfer),
                    "ComputeDigests({transfer:?}) after Release"
                );
                let commit_aux = self.accepted.get(&transfer).map(|c| &c.aux);
                ensure!(
                    commit_aux.is_none_or(|a| *a == aux),
                    "ComputeDigests({transfer:?}) with an aux record other than the COMMIT's"
                );
                self.digest_jobs
                    .push((transfer, algorithm, page_digests, aux));
            }
            ReceiverAction::Release(t) => {
                ensure!(
                    self.fenced.contains(&t),
                    "Release({t:?}) before its fence completed: a write could still land"
                );
                ensure!(
                    !self.digest_jobs.iter().any(|j| j.0 == t),
                    "Release({t:?}) while a digest job still reads the pages"
                );
                ensure!(self.released.insert(t), "Release({t:?}) twice");
                ensure!(
                    !self.outcomes.contains_key(&t),
                    "Release({t:?}) after its outcome"
                );
                let scope = &self.scopes[&t];
                ensure!(!scope.open, "Release({t:?}) with its scope open");
                for p in scope.pages.clone() {
                    let page = &mut self.pages[p as usize];
                    ensure!(
                        page.owner == Some(t),
                        "Release({t:?}) of page {p} it does not hold"
                    );
                    page.owner = None;
                    page.quarantined = false;
                }
            }
        }
        Ok(())
    }

    /// A moving reservation's pages, for a new scope on a live lane (SPEC §9.2): only once its
    /// own fence completed (no write of the old reservation can land any more), before any
    /// release or outcome.
    pub fn reopen_pages(&self, t: TransferRef) -> Result<Vec<u32>, Violation> {
        ensure!(
            self.fenced.contains(&t),
            "Reopen({t:?}) before its fence completed: a write of the old reservation could still land"
        );
        ensure!(!self.released.contains(&t), "Reopen({t:?}) after Release");
        ensure!(
            !self.outcomes.contains_key(&t),
            "Reopen({t:?}) after its outcome"
        );
        ensure!(
            !self.digest_jobs.iter().any(|j| j.0 == t) && !self.accepted.contains_key(&t),
            "Reopen({t:?}) of a reservation whose COMMIT was accepted"
        );
        Ok(self.reserved[&t].clone())
    }

    /// The session reserved `old`'s pages again as `new` (a move): the pages pass to the
    /// new reservation with a new open scope; `old` ends as moved.
    pub fn moved(&mut self, old: TransferRef, new: TransferRef) -> Result<(), Violation> {
        let pages = self.reserved[&old].clone();
        for &p in &pages {
            let page = &mut self.pages[p as usize];
            ensure!(
                page.owner == Some(old) && !page.quarantined,
                "moved {old:?}: page {p} is {:?}, quarantined {}",
                page.owner,
                page.quarantined
            );
            page.owner = Some(new);
        }
        ensure!(
            self.outcomes.insert(old, RxOutcome::Moved).is_none(),
            "moved {old:?} after its outcome"
        );
        self.released.insert(old);
        self.scopes.insert(
            new,
            AccessScope {
                pages: pages.clone(),
                open: true,
            },
        );
        self.reserved.insert(new, pages);
        Ok(())
    }

    /// Completes the `i`-th pending fence: closes the scope. Returns the reservation.
    pub fn complete_fence(&mut self, i: usize) -> TransferRef {
        let t = self.fences.remove(i);
        if let Some(s) = self.scopes.get_mut(&t) {
            s.open = false;
        }
        self.fenced.insert(t);
        t
    }

    /// Completes the `i`-th digest job over the landed memory.
    pub fn complete_digests(&mut self, i: usize) -> (TransferRef, TransferDigests) {
        let (t, algorithm, page_digests, aux) = self.digest_jobs.remove(i);
        let d = digest::digests(
            t,
            algorithm,
            self.buffers,
            &self.contents(t),
            page_digests,
            &aux,
        );
        self.digested.insert(t, d.clone());
        (t, d)
    }

    /// Checks one event of the receiver session. `truth` is the content the sender wrote,
    /// when known (two honest sessions), to check delivery against ground truth.
    pub fn event(
        &mut self,
        event: &ReceiverEvent,
        truth: Option<&[Content]>,
    ) -> Result<(), Violation> {
        match event {
            ReceiverEvent::Delivered(d) => {
                let t = d.transfer;
                ensure!(
                    self.outcomes.insert(t, RxOutcome::Delivered).is_none(),
                    "second outcome for {t:?} (Delivered)"
                );
                ensure!(
                    !self.released.contains(&t),
                    "Delivered({t:?}) after Release"
                );
                ensure!(
                    self.fenced.contains(&t),
                    "Delivered({t:?}) without a completed fence"
                );
                ensure!(
                    !self.digest_jobs.iter().any(|j| j.0 == t),
                    "Delivered({t:?}) with its digest job still running"
                );
                let Some(landed) = self.digested.get(&t) else {
                    return Err(Violation(format!(
                        "Delivered({t:?}) without digests over the landed memory"
                    )));
                };
                let Some(commit) = self.accepted.get(&t) else {
                    return Err(Violation(format!(
                        "Delivered({t:?}) without an accepted COMMIT"
                    )));
                };
                ensure!(
                    landed.buffers == commit.buffer_digests,
                    "Delivered({t:?}) although the landed digests differ from the COMMIT's"
                );
                ensure!(
                    landed.aux == commit.aux_digest && d.aux == commit.aux,
                    "Delivered({t:?}) with an aux record that does not verify against the COMMIT's"
                );
                let pages = &self.reserved[&t];
                ensure!(
                    d.pages as usize == pages.len() && commit.pages == d.pages,
                    "Delivered({t:?}) with {} pages, {} reserved",
                    d.pages,
                    pages.len()
                );
                let now = self.contents(t);
                let at_digest =
                    digest::digests(t, commit.digest, self.buffers, &now, false, &commit.aux);
                ensure!(
                    at_digest.buffers == landed.buffers,
                    "Delivered({t:?}): the pages changed after they were digested"
                );
                for &p in pages {
                    ensure!(
                        !self.pages[p as usize].quarantined,
                        "Delivered({t:?}) with quarantined page {p}"
                    );
                }
                if let Some(truth) = truth {
                    ensure!(
                        now == truth,
                        "Delivered({t:?}) holding {now:?}, the sender wrote {truth:?} (unverified data delivered)"
                    );
                }
                // The engine takes the pages (and returns them once it is done with them).
                for &p in pages {
                    self.pages[p as usize].owner = None;
                }
            }
            ReceiverEvent::Failed { transfer, .. } => {
                let t = *transfer;
                ensure!(
                    self.outcomes.insert(t, RxOutcome::Failed).is_none(),
                    "second outcome for {t:?} (Failed)"
                );
                ensure!(
                    self.released.contains(&t),
                    "Failed({t:?}) reported before its pages were released"
                );
            }
        }
        Ok(())
    }

    /// Records the COMMIT the session accepted (it asked for a fence without quarantine).
    pub fn accept(&mut self, commit: Commit) {
        self.accepted.entry(commit.transfer).or_insert(commit);
    }

    /// End-of-run accounting: every reservation ended, every page is back.
    pub fn check_quiescent(&self) -> Result<(), Violation> {
        for t in self.reserved.keys() {
            ensure!(
                self.outcomes.contains_key(t),
                "reservation {t:?} never ended"
            );
        }
        for (p, page) in self.pages.iter().enumerate() {
            ensure!(
                page.owner.is_none(),
                "page {p} leaked (still leased to {:?})",
                page.owner
            );
        }
        ensure!(self.fences.is_empty(), "fences left pending");
        ensure!(self.digest_jobs.is_empty(), "digest jobs left running");
        Ok(())
    }
}

/// A posted page write not yet reported.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Write {
    /// Its reservation.
    pub transfer: TransferRef,
    /// The write.
    pub write: PageWrite,
}

/// How a submission ended on the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TxOutcome {
    /// Verified.
    Verified,
    /// Failed.
    Failed,
}

/// One chunk's digest job on the sender.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TxDigestJob {
    /// Its reservation.
    pub transfer: TransferRef,
    /// The algorithm.
    pub algorithm: DigestAlgorithm,
    /// Page digests too.
    pub page_digests: bool,
    /// Ordinals `first .. first + pages`.
    pub first: u32,
    /// Pages in the chunk.
    pub pages: u32,
    /// `Some` on the final chunk.
    pub aux: Option<Vec<u8>>,
}

/// The sender's driver: posted writes, digest jobs, source pages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TxDriver {
    /// Posted writes whose outcome is not reported yet.
    pub writes: Vec<Write>,
    /// Digest jobs running, in the order emitted.
    pub digest_jobs: Vec<TxDigestJob>,
    /// Per reservation: the next ordinal a write and a digest job must start at (chunks are
    /// posted and digested in order, each ordinal once).
    pub next_ordinal: BTreeMap<TransferRef, (u32, u32)>,
    /// Pages per submitted transfer id (current submission).
    pub submitted: BTreeMap<TransferId, u32>,
    /// Submissions whose source was released (transfer id -> count of releases).
    pub released: BTreeMap<TransferId, u32>,
    /// Submissions ended (transfer id -> count of outcomes), and the last outcome.
    pub outcomes: BTreeMap<TransferId, (u32, TxOutcome)>,
    /// Submissions made per transfer id.
    pub submissions: BTreeMap<TransferId, u32>,
    /// Transfers whose writes were cancelled.
    pub cancelled: BTreeSet<TransferRef>,
}

impl TxDriver {
    /// Records a submission of `pages` source pages.
    pub fn submit(&mut self, transfer_id: TransferId, pages: u32) {
        self.submitted.insert(transfer_id, pages);
        *self.submissions.entry(transfer_id).or_default() += 1;
    }

    /// Applies one effect of the sender session.
    pub fn apply(&mut self, action: SenderAction) -> Result<(), Violation> {
        match action {
            SenderAction::PostWrites {
                transfer, writes, ..
            } => {
                let id = transfer.transfer_id;
                ensure!(
                    self.submitted.contains_key(&id),
                    "PostWrites for {transfer:?}, never submitted"
                );
                ensure!(
                    self.released.get(&id).copied().unwrap_or(0)
                        < self.submissions.get(&id).copied().unwrap_or(0),
                    "PostWrites for {transfer:?} after its source was released"
                );
                let next = &mut self.next_ordinal.entry(transfer).or_default().0;
                for w in writes {
                    ensure!(
                        w.ordinal == *next && w.ordinal < self.submitted[&id],
                        "PostWrites for {transfer:?}: ordinal {} where {} was next, of {} pages",
                        w.ordinal,
                        next,
                        self.submitted[&id]
                    );
                    *next += 1;
                    self.writes.push(Write { transfer, write: w });
                }
            }
            SenderAction::ComputeDigests {
                transfer,
                algorithm,
                page_digests,
                first,
                pages,
                aux,
            } => {
                let id = transfer.transfer_id;
                let total = self.submitted.get(&id).copied().unwrap_or(0);
                let next = &mut self.next_ordinal.entry(transfer).or_default().1;
                ensure!(
                    first == *next && pages > 0 && first + pages <= total,
                    "ComputeDigests for {transfer:?}: ordinals {first}..+{pages} where {next} was next, of {total}"
                );
                *next += pages;
                ensure!(
                    aux.is_some() == (*next == total),
                    "ComputeDigests for {transfer:?}: aux {} on a chunk ending at {next} of {total}",
                    if aux.is_some() { "given" } else { "missing" }
                );
                self.digest_jobs.push(TxDigestJob {
                    transfer,
                    algorithm,
                    page_digests,
                    first,
                    pages,
                    aux,
                });
            }
            SenderAction::CancelWrites(t) => {
                // Every write of this model is posted at once: nothing is left to cancel.
                self.cancelled.insert(t);
            }
            SenderAction::ReleaseSource(id) => {
                ensure!(
                    !self.writes.iter().any(|w| w.transfer.transfer_id == id),
                    "ReleaseSource({id}) while a posted write still reads the source"
                );
                ensure!(
                    !self
                        .digest_jobs
                        .iter()
                        .any(|j| j.transfer.transfer_id == id),
                    "ReleaseSource({id}) while a digest job still reads the source"
                );
                self.next_ordinal.retain(|t, _| t.transfer_id != id);
                let n = self.released.entry(id).or_default();
                *n += 1;
                ensure!(
                    *n <= self.submissions.get(&id).copied().unwrap_or(0),
                    "ReleaseSource({id}) more often than it was submitted"
                );
            }
        }
        Ok(())
    }

    /// Completes the `i`-th digest job over the source pages: the transfer's digests for a
    /// final chunk (`Some`), nothing for another one (`None`, `handle_chunk_digested`).
    pub fn complete_digests(
        &mut self,
        i: usize,
        buffers: usize,
    ) -> (TransferRef, Option<TransferDigests>) {
        let job = self.digest_jobs.remove(i);
        let t = job.transfer;
        let Some(aux) = job.aux else {
            return (t, None);
        };
        let pages = self.submitted.get(&t.transfer_id).copied().unwrap_or(0);
        let contents = digest::source_contents(t.transfer_id, pages);
        (
            t,
            Some(digest::digests(
                t,
                job.algorithm,
                buffers,
                &contents,
                job.page_digests,
                &aux,
            )),
        )
    }

    /// Checks one event of the sender session.
    pub fn event(&mut self, event: &SenderEvent) -> Result<(), Violation> {
        let (t, outcome) = match event {
            SenderEvent::Verified(t) => (*t, TxOutcome::Verified),
            SenderEvent::Failed { transfer, .. } => (*transfer, TxOutcome::Failed),
            // A route for a request not submitted yet: no outcome, nothing to account.
            SenderEvent::Announced { .. } => return Ok(()),
        };
        let id = t.transfer_id;
        let e = self.outcomes.entry(id).or_insert((0, outcome));
        e.0 += 1;
        e.1 = outcome;
        let ended = e.0;
        ensure!(
            ended <= self.submissions.get(&id).copied().unwrap_or(0),
            "more outcomes than submissions for transfer {id} ({event:?})"
        );
        ensure!(
            self.released.get(&id).copied().unwrap_or(0) >= ended,
            "{event:?} reported before its source was released"
        );
        Ok(())
    }

    /// End-of-run accounting: every submission ended and released its source once.
    pub fn check_quiescent(&self) -> Result<(), Violation> {
        for (id, &n) in &self.submissions {
            let ended = self.outcomes.get(id).map_or(0, |o| o.0);
            ensure!(
                ended == n,
                "transfer {id}: {n} submissions, {ended} outcomes"
            );
            let released = self.released.get(id).copied().unwrap_or(0);
            ensure!(
                released == n,
                "transfer {id}: {n} submissions, source released {released} times"
            );
        }
        ensure!(self.writes.is_empty(), "writes left unreported");
        ensure!(self.digest_jobs.is_empty(), "digest jobs left running");
        Ok(())
    }

    /// Removes the `i`-th posted write, for reporting its outcome.
    pub fn take_write(&mut self, i: usize) -> Write {
        self.writes.remove(i)
    }
}

/// The outcome a write reports: `Completed` if it landed (or was silently lost), else
/// `Failed` (refused under a closed scope).
pub fn outcome(landed: bool) -> WriteOutcome {
    if landed {
        WriteOutcome::Completed
    } else {
        WriteOutcome::Failed
    }
}
