//! Reading and writing protocol frames on a stream, without reading past the frame: the bytes
//! after a stream's header belong to the stream's payload.

use std::io;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::{self, DecodeError, EncodeError, LENGTH_PREFIX};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed or ended mid-frame.
    #[error("stream error: {0}")]
    Io(#[from] io::Error),
    /// The stream ended cleanly before a frame began.
    #[error("stream ended before a frame")]
    Eof,
    /// The frame is too large or malformed.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The message could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// Reads exactly one frame of at most `max` body bytes.
pub async fn read_frame<T, R>(reader: &mut R, max: usize) -> Result<T, FrameError>
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin,
{
    let frame = read_raw_frame(reader, max).await?;
    match protocol::decode(&frame, max)? {
        Some((msg, _)) => Ok(msg),
        None => Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
    }
}

/// Reads exactly one frame, prefix included, without decoding it.
pub async fn read_raw_frame<R>(reader: &mut R, max: usize) -> Result<Vec<u8>, FrameError>
where
    R: AsyncRead + Unpin,
{
    let mut prefix = [0u8; LENGTH_PREFIX];
    let mut filled = 0;
    while filled < LENGTH_PREFIX {
        let n = reader.read(&mut prefix[filled..]).await?;
        if n == 0 {
            return Err(if filled == 0 {
                FrameError::Eof
            } else {
                FrameError::Io(io::ErrorKind::UnexpectedEof.into())
            });
        }
        filled += n;
    }
    let len = protocol::frame_len(&prefix, max)?.unwrap_or_default();
    let mut frame = vec![0u8; LENGTH_PREFIX + len];
    frame[..LENGTH_PREFIX].copy_from_slice(&prefix);
    reader.read_exact(&mut frame[LENGTH_PREFIX..]).await?;
    Ok(frame)
}

/// Reads frames until the stream ends and hands each to `tx`: lets a `select!` loop receive
/// frames without cancelling a half-read one. A clean end of stream closes the channel; an error
/// is sent, then the channel closes.
///
/// Results are boxed: channel slots are allocated in blocks up front, and small slots keep idle
/// sessions small.
pub async fn forward_frames<T, R>(mut reader: R, max: usize, tx: tokio::sync::mpsc::Sender<Box<Result<T, FrameError>>>)
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin,
{
    loop {
        match read_frame::<T, _>(&mut reader, max).await {
            Ok(message) => {
                if tx.send(Box::new(Ok(message))).await.is_err() {
                    return;
                }
            }
            Err(FrameError::Eof) => return,
            Err(e) => {
                let _ = tx.send(Box::new(Err(e))).await;
                return;
            }
        }
    }
}

/// Writes one frame and flushes it.
pub async fn write_frame<T, W>(writer: &mut W, msg: &T, max: usize) -> Result<(), FrameError>
where
    T: Serialize,
    W: AsyncWrite + Unpin,
{
    let bytes = protocol::encode(msg, max)?;
    writer.write_all(&bytes).await?;
    writer.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ErrorCode, MAX_STREAM_FRAME, StreamResult};

    #[tokio::test]
    async fn reads_one_frame_and_leaves_the_payload() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            write_frame(&mut a, &StreamResult::refused(ErrorCode::Timeout, "slow"), MAX_STREAM_FRAME).await.unwrap();
            a.write_all(b"payload").await.unwrap();
        });
        let result: StreamResult = read_frame(&mut b, MAX_STREAM_FRAME).await.unwrap();
        assert_eq!(result.code, Some(ErrorCode::Timeout));
        let mut rest = [0u8; 7];
        b.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"payload");
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn eof_before_and_inside_a_frame_are_told_apart() {
        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(matches!(read_frame::<StreamResult, _>(&mut b, 64).await, Err(FrameError::Eof)));

        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[0, 0, 0, 10, b'{']).await.unwrap();
        drop(a);
        assert!(matches!(read_frame::<StreamResult, _>(&mut b, 64).await, Err(FrameError::Io(_))));
    }

    #[tokio::test]
    async fn oversized_prefix_is_refused_without_reading_the_body() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let err = read_frame::<StreamResult, _>(&mut b, MAX_STREAM_FRAME).await.unwrap_err();
        assert!(matches!(err, FrameError::Decode(DecodeError::TooLarge { .. })), "{err}");
    }
}
