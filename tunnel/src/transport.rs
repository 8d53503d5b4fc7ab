//! The byte transport under a WebSocket: plain TCP or TLS over TCP, on either end.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection to or from a peer, with or without TLS.
pub enum Transport {
    /// Plain TCP (behind a TLS-terminating ingress, or tests).
    Plain(TcpStream),
    /// TLS we initiated.
    ClientTls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// TLS we accepted.
    ServerTls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Transport {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Self::Plain(s) => s,
            Self::ClientTls(s) => s.get_ref().0,
            Self::ServerTls(s) => s.get_ref().0,
        }
    }

    /// The peer's socket address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().peer_addr()
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Transport::Plain($s) => $e,
            Transport::ClientTls($s) => $e,
            Transport::ServerTls($s) => $e,
        }
    };
}

impl AsyncRead for Transport {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Transport {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::ClientTls(s) => s.is_write_vectored(),
            Self::ServerTls(s) => s.is_write_vectored(),
        }
    }
}
