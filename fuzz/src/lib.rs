//! What the fuzz targets share: a reader that hands the input over in uneven pieces (the way a
//! socket does), and a runtime whose clock only moves when every task waits (so timeouts and
//! keepalives fire at once instead of stalling the fuzzer).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};

/// Delivers `data` in pieces whose sizes cycle through `pattern` (0 stands for 1), then EOF.
/// Counts what was taken, so a target can check how much a parser consumed.
#[derive(Debug)]
pub struct Pieces<'a> {
    data: &'a [u8],
    pattern: &'a [u8],
    turn: usize,
    /// Bytes handed out so far.
    pub consumed: usize,
}

impl<'a> Pieces<'a> {
    /// Splits `input`: its first byte says how many pattern bytes follow (at most 8); the rest is
    /// the data.
    pub fn from_input(input: &'a [u8]) -> Self {
        let (n, rest) = match input.split_first() {
            Some((n, rest)) => (usize::from(*n % 9).min(rest.len()), rest),
            None => (0, input),
        };
        let (pattern, data) = rest.split_at(n);
        Self { data, pattern, turn: 0, consumed: 0 }
    }

    /// The data to be delivered, all of it.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    fn next_size(&mut self) -> usize {
        if self.pattern.is_empty() {
            return usize::MAX;
        }
        let size = self.pattern[self.turn % self.pattern.len()];
        self.turn += 1;
        usize::from(size.max(1))
    }
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let n = self.next_size().min(self.data.len() - self.consumed).min(buf.remaining());
        let at = self.consumed;
        buf.put_slice(&self.data[at..at + n]);
        self.consumed += n;
        Poll::Ready(Ok(()))
    }
}

/// A current-thread runtime with the clock paused: when every task waits, time jumps to the next
/// timer, so a target never sleeps for real.
pub fn runtime() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build() {
        Ok(rt) => rt,
        Err(e) => panic!("the fuzz harness cannot build a runtime: {e}"),
    }
}

/// Runs `future` to its end, or for at most `limit` of (virtual) time.
pub fn run_for<F: Future>(limit: Duration, future: F) -> Option<F::Output> {
    runtime().block_on(async { tokio::time::timeout(limit, future).await.ok() })
}
