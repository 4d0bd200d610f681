//! A command's output buffer: the newest [`OUTPUT_BUFFER_BYTES`] of its
//! output (stdout and stderr together, in arrival order), addressed by
//! absolute byte offsets from the command's first output byte.
//!
//! Output is kept as chunks of one stream each, at most [`MAX_CHUNK`]
//! bytes; a small piece is appended to the last chunk when it is of the
//! same stream. Every chunk also costs [`CHUNK_OVERHEAD`] bytes of the
//! budget ([`CAPACITY`]), so many tiny pieces cannot make the buffer hold
//! more memory than its size says. When a piece does not fit, the oldest
//! whole chunks are dropped and the start offset moves past them. The
//! budget has room for a chunk beyond [`OUTPUT_BUFFER_BYTES`], so at least
//! that much output is kept (unless stdout and stderr interleave in pieces
//! so small that their overhead takes the room).

use std::collections::VecDeque;

/// Output kept per command, at least (the README's figure): 1 MiB.
pub const OUTPUT_BUFFER_BYTES: usize = 1024 * 1024;
/// Largest chunk kept (and largest piece of output sent in one response).
pub const MAX_CHUNK: usize = 64 * 1024;
/// What a chunk costs beyond its bytes, for the budget.
pub const CHUNK_OVERHEAD: usize = 64;
/// The budget of a command's buffer: [`OUTPUT_BUFFER_BYTES`], a chunk more
/// (whole chunks are dropped), and the overhead of 32 chunks.
pub const CAPACITY: usize = OUTPUT_BUFFER_BYTES + MAX_CHUNK + 32 * CHUNK_OVERHEAD;

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// stdout (and everything a terminal shows).
    Stdout,
    /// stderr.
    Stderr,
}

#[derive(Debug)]
struct Chunk {
    offset: u64,
    stream: Stream,
    data: Vec<u8>,
}

/// A piece of output read back: where it starts, its stream, its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Absolute offset of its first byte.
    pub offset: u64,
    /// Its stream.
    pub stream: Stream,
    /// The bytes.
    pub data: Vec<u8>,
}

/// The output buffer of one command.
#[derive(Debug)]
pub struct OutputRing {
    chunks: VecDeque<Chunk>,
    /// Offset of the first byte kept (the end when nothing is kept).
    start: u64,
    /// Offset after the last byte ever appended.
    end: u64,
    /// Bytes plus overhead of the chunks kept.
    cost: usize,
    /// The budget for `cost`.
    capacity: usize,
}

impl Default for OutputRing {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl OutputRing {
    /// An empty buffer holding at most `capacity` bytes (with overhead); at
    /// least one chunk always fits.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            chunks: VecDeque::new(),
            start: 0,
            end: 0,
            cost: 0,
            capacity: capacity.max(MAX_CHUNK + CHUNK_OVERHEAD),
        }
    }

    /// Offset of the oldest byte kept.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Offset after the newest byte (all output so far).
    pub fn end(&self) -> u64 {
        self.end
    }

    /// What the start would be after [`Self::push`] of `len` bytes (at most
    /// [`MAX_CHUNK`]) of `stream`: the oldest offset still kept then.
    pub fn start_after_push(&self, stream: Stream, len: usize) -> u64 {
        let (extra, _) = self.push_cost(stream, len);
        let mut over = (self.cost + extra).saturating_sub(self.capacity);
        let mut start = self.start;
        for c in &self.chunks {
            if over == 0 {
                break;
            }
            over = over.saturating_sub(c.data.len() + CHUNK_OVERHEAD);
            start = c.offset + c.data.len() as u64;
        }
        start.min(self.end)
    }

    /// The cost `len` more bytes of `stream` add, and whether they join
    /// the last chunk.
    fn push_cost(&self, stream: Stream, len: usize) -> (usize, bool) {
        let joins = self
            .chunks
            .back()
            .is_some_and(|c| c.stream == stream && c.data.len() + len <= MAX_CHUNK);
        (if joins { len } else { len + CHUNK_OVERHEAD }, joins)
    }

    /// Appends `data` (callers split output into pieces of at most
    /// [`MAX_CHUNK`]; a larger piece keeps only its last MAX_CHUNK bytes),
    /// dropping the oldest chunks that no longer fit.
    pub fn push(&mut self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let data = if data.len() > MAX_CHUNK {
            let skip = data.len() - MAX_CHUNK;
            self.push_gap(skip as u64);
            &data[skip..]
        } else {
            data
        };
        let (extra, joins) = self.push_cost(stream, data.len());
        while self.cost + extra > self.capacity {
            let Some(old) = self.chunks.pop_front() else {
                break;
            };
            self.cost -= old.data.len() + CHUNK_OVERHEAD;
            self.start = old.offset + old.data.len() as u64;
        }
        // The last chunk may just have been dropped: join only if it is there.
        match self.chunks.back_mut() {
            Some(last) if joins && last.offset + last.data.len() as u64 == self.end => {
                last.data.extend_from_slice(data);
                self.cost += data.len();
            }
            _ => {
                self.chunks.push_back(Chunk {
                    offset: self.end,
                    stream,
                    data: data.to_vec(),
                });
                self.cost += data.len() + CHUNK_OVERHEAD;
            }
        }
        self.end += data.len() as u64;
        if self.chunks.len() == 1 || self.start > self.end {
            self.start = self.chunks.front().map_or(self.end, |c| c.offset);
        }
    }

    /// Counts `n` bytes of output that are not kept: everything before is
    /// dropped too, and the start moves past them.
    fn push_gap(&mut self, n: u64) {
        self.chunks.clear();
        self.cost = 0;
        self.end += n;
        self.start = self.end;
    }

    /// Drops every byte kept (the offsets stay): for a command whose output
    /// is no longer worth its memory.
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.cost = 0;
        self.start = self.end;
    }

    /// Up to `max` bytes of one chunk from `offset` on: from the oldest kept
    /// when `offset` is older; None at (or past) the end.
    pub fn read(&self, offset: u64, max: usize) -> Option<Piece> {
        let offset = offset.max(self.start);
        if offset >= self.end {
            return None;
        }
        // Chunks are contiguous and sorted: the last one starting at or
        // before `offset` holds it.
        let i = self.chunks.partition_point(|c| c.offset <= offset);
        let c = self.chunks.get(i.checked_sub(1)?)?;
        let from = usize::try_from(offset - c.offset).ok()?;
        let to = c.data.len().min(from.saturating_add(max.max(1)));
        Some(Piece {
            offset,
            stream: c.stream,
            data: c.data.get(from..to)?.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(r: &OutputRing, from: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = from;
        while let Some(p) = r.read(at, 1000) {
            assert_eq!(p.offset, at.max(r.start()));
            at = p.offset + p.data.len() as u64;
            out.extend_from_slice(&p.data);
        }
        out
    }

    #[test]
    fn keeps_everything_below_the_capacity_and_reads_from_any_offset() {
        let mut r = OutputRing::default();
        r.push(Stream::Stdout, b"hello ");
        r.push(Stream::Stderr, b"oops ");
        r.push(Stream::Stdout, b"world");
        assert_eq!((r.start(), r.end()), (0, 16));
        assert_eq!(all(&r, 0), b"hello oops world");
        assert_eq!(all(&r, 3), b"lo oops world");
        let p = r.read(7, 100).unwrap();
        assert_eq!(
            (p.offset, p.stream, &p.data[..]),
            (7, Stream::Stderr, &b"ops "[..])
        );
        assert_eq!(r.read(16, 10), None);
        assert_eq!(r.read(99, 10), None);
        // `max` bounds a piece.
        assert_eq!(r.read(0, 2).unwrap().data, b"he");
    }

    #[test]
    fn small_pieces_of_one_stream_join_one_chunk() {
        let mut r = OutputRing::default();
        for _ in 0..1000 {
            r.push(Stream::Stdout, b"x");
        }
        assert_eq!(r.chunks.len(), 1);
        assert_eq!(r.cost, 1000 + CHUNK_OVERHEAD);
    }

    #[test]
    fn drops_the_oldest_chunks_past_the_capacity() {
        let mut r = OutputRing::default();
        let piece = vec![b'a'; MAX_CHUNK];
        // 3 MiB in 64 KiB pieces, alternating streams so none join.
        let n = 3 * OUTPUT_BUFFER_BYTES / MAX_CHUNK + 1;
        for i in 0..n {
            let s = if i % 2 == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            let predicted = r.start_after_push(s, piece.len());
            r.push(s, &piece);
            assert_eq!(r.start(), predicted, "chunk {i}");
        }
        assert_eq!(r.end(), (n * MAX_CHUNK) as u64);
        assert!(r.cost <= CAPACITY, "{}", r.cost);
        let kept = r.end() - r.start();
        // At least 1 MiB is kept, at most a chunk more.
        assert!(kept >= OUTPUT_BUFFER_BYTES as u64, "{kept}");
        assert!(kept <= (OUTPUT_BUFFER_BYTES + MAX_CHUNK) as u64, "{kept}");
        assert_eq!(r.start() % MAX_CHUNK as u64, 0, "whole chunks are dropped");
        // An old offset reads from the oldest kept.
        assert_eq!(r.read(0, 10).unwrap().offset, r.start());
        assert_eq!(all(&r, 0).len() as u64, kept);
    }

    #[test]
    fn tiny_pieces_of_alternating_streams_are_bounded_by_their_overhead() {
        let mut r = OutputRing::with_capacity(64 * 1024 + CHUNK_OVERHEAD);
        for i in 0..100_000u32 {
            let s = if i % 2 == 0 {
                Stream::Stdout
            } else {
                Stream::Stderr
            };
            r.push(s, b"y");
        }
        assert!(r.cost <= r.capacity);
        assert!(r.chunks.len() <= r.capacity / (CHUNK_OVERHEAD + 1));
        assert_eq!(r.end(), 100_000);
    }

    #[test]
    fn a_piece_over_a_chunk_keeps_its_tail_and_clear_keeps_offsets() {
        let mut r = OutputRing::default();
        r.push(Stream::Stdout, b"head");
        let mut big = vec![b'b'; MAX_CHUNK + 10];
        big[MAX_CHUNK + 9] = b'!';
        r.push(Stream::Stdout, &big);
        assert_eq!(r.end(), 4 + big.len() as u64);
        assert_eq!(r.start(), r.end() - MAX_CHUNK as u64);
        assert_eq!(*all(&r, 0).last().unwrap(), b'!');
        r.clear();
        assert_eq!(
            (r.start(), r.end()),
            (4 + big.len() as u64, 4 + big.len() as u64)
        );
        assert_eq!(r.read(0, 10), None);
        r.push(Stream::Stderr, b"more");
        assert_eq!(all(&r, 0), b"more");
    }
}
