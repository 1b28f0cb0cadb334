//! Write sessions: every put, delete and touch of the SDK applies exactly
//! once, however often it is retried.
//!
//! A session is a sequential writer (see `WriteSession` in `blob.proto`):
//! one write in flight, numbered 1, 2, 3, ..., every attempt of a write
//! sent with its number. A [`Client`](crate::Client) keeps a pool of them,
//! shared by its clones: a write takes an idle session (or makes one), and
//! gives it back when it ends — however it ends, even if its future is
//! dropped. The pool grows to the number of writes in flight at once.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tidepool_proto::v1::WriteSession;

/// A write whose attempts were refused with `SESSION_EXPIRED` is retried
/// with a re-opened session only if it began less than this long ago: no
/// earlier attempt of it can then have applied unseen (an applied attempt
/// keeps the session alive on the shard for 5 minutes at least, 30 as a
/// rule).
pub(crate) const REOPEN_WINDOW: Duration = Duration::from_secs(120);

/// One sequential writer.
#[derive(Debug)]
struct Session {
    id: [u8; 16],
    /// The last sequence number used.
    last: u64,
    /// Shards that answered a write of this session: they know it.
    opened: BTreeSet<u32>,
}

/// The idle sessions of a client.
#[derive(Debug, Default)]
pub(crate) struct SessionPool {
    idle: Mutex<Vec<Session>>,
}

impl SessionPool {
    /// A session for one write, with its sequence number taken.
    pub fn begin(&self) -> SessionWrite<'_> {
        let mut session = self.idle.lock().pop().unwrap_or_else(|| Session {
            id: rand::random(),
            last: 0,
            opened: BTreeSet::new(),
        });
        session.last += 1;
        SessionWrite {
            pool: self,
            sequence: session.last,
            session: Some(session),
            began: Instant::now(),
        }
    }

    /// Sessions idle in the pool.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.idle.lock().len()
    }
}

/// One write's hold on a session; gives the session back when dropped.
#[derive(Debug)]
pub(crate) struct SessionWrite<'a> {
    pool: &'a SessionPool,
    session: Option<Session>,
    sequence: u64,
    began: Instant,
}

impl SessionWrite<'_> {
    fn session(&self) -> &Session {
        self.session.as_ref().expect("held until dropped")
    }

    /// What an attempt of this write on `shard` sends. It opens the
    /// session on a shard that has not answered it only while the write
    /// is younger than [`REOPEN_WINDOW`]: an earlier attempt that applied
    /// unseen keeps the session for 5 minutes at least, and an older
    /// write's attempt that opened a session the shard had forgotten since
    /// applied again (a call deadline past 5 minutes, a shard without a
    /// leader that long). Past it, a shard that forgot the session answers
    /// `SESSION_EXPIRED`, which ends the write.
    pub fn tag(&self, shard: u32) -> WriteSession {
        let session = self.session();
        WriteSession {
            id: session.id.to_vec(),
            sequence: self.sequence,
            opens: !session.opened.contains(&shard) && self.began.elapsed() < REOPEN_WINDOW,
        }
    }

    /// `shard` answered this write: it knows the session now.
    pub fn opened(&mut self, shard: u32) {
        if let Some(session) = self.session.as_mut() {
            session.opened.insert(shard);
        }
    }

    /// `shard` no longer knows the session (`SESSION_EXPIRED`). Whether the
    /// write may be sent again, opening the session anew: only while it is
    /// young enough that no attempt of it can have applied unseen.
    pub fn reopen(&mut self, shard: u32) -> bool {
        if let Some(session) = self.session.as_mut() {
            session.opened.remove(&shard);
        }
        self.began.elapsed() < REOPEN_WINDOW
    }
}

impl Drop for SessionWrite<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            self.pool.idle.lock().push(session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_serves_one_write_at_a_time_with_growing_numbers() {
        let pool = SessionPool::default();
        let first = pool.begin();
        let second = pool.begin();
        assert_ne!(first.tag(1).id, second.tag(1).id, "two writes in flight");
        assert_eq!((first.tag(1).sequence, second.tag(1).sequence), (1, 1));
        let id = second.tag(1).id;
        drop(first);
        drop(second);
        assert_eq!(pool.idle(), 2);
        // The last one given back is taken first, with the next number.
        let again = pool.begin();
        assert_eq!((again.tag(1).id, again.tag(1).sequence), (id, 2));
    }

    #[test]
    fn opening_follows_the_answers_of_each_shard() {
        let pool = SessionPool::default();
        let mut write = pool.begin();
        write.opened(3);
        assert!(!write.tag(3).opens);
        assert!(write.tag(4).opens);
        assert!(write.reopen(3), "a young write may reopen");
        assert!(write.tag(3).opens);
        drop(write);
        let next = pool.begin();
        assert_eq!(next.tag(3).sequence, 2);
        assert!(next.tag(3).opens);
    }

    /// A write older than the re-open window opens no session, even on a
    /// shard it never heard from: one of its attempts may have applied
    /// there and the session since been forgotten.
    #[test]
    fn an_old_write_opens_no_session() {
        let pool = SessionPool::default();
        let mut write = pool.begin();
        assert!(write.tag(5).opens);
        let Some(old) = Instant::now().checked_sub(REOPEN_WINDOW) else {
            return; // the machine has been up for less than the window
        };
        write.began = old;
        assert!(!write.tag(5).opens);
        assert!(!write.reopen(5));
    }
}
