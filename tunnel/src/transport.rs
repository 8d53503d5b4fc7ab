//! The byte transport under a WebSocket: plain TCP or TLS over TCP, on either end.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// Writes all of `bytes` and flushes them: for a message the peer must receive before it
/// answers (a request, a CONNECT's `200`).
///
/// On a TLS stream `write_all` alone is not enough. tokio-rustls takes the bytes into its session
/// and answers that they were written even when the socket would block (a full send buffer, or
/// the kernel's TCP memory under pressure); they stay in the session until the next write or a
/// flush. A caller that then only reads waits forever for an answer to a request its peer never
/// got.
pub async fn send_all<S: AsyncWrite + Unpin + ?Sized>(stream: &mut S, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, DuplexStream};

    /// A stream whose next write, once armed, would block once: the socket's send buffer is full
    /// for a moment, then has room again (the waker is woken).
    struct BlocksOnce {
        inner: DuplexStream,
        armed: bool,
        blocked: bool,
    }

    impl AsyncRead for BlocksOnce {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for BlocksOnce {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            if self.armed {
                self.armed = false;
                self.blocked = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Pin::new(&mut self.inner).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    fn tls_pair() -> (tokio_rustls::TlsConnector, tokio_rustls::TlsAcceptor) {
        let cert = rcgen::generate_simple_self_signed(vec!["peer.test".to_owned()]).unwrap();
        let der = cert.cert.der().clone();
        let key = rustls_pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (tokio_rustls::TlsConnector::from(Arc::new(client)), tokio_rustls::TlsAcceptor::from(Arc::new(server)))
    }

    /// The request leaves even when the socket would block just as it is written: the client
    /// then only reads, and the server answers only once it has the whole request. (With
    /// `write_all` alone the request stays in the TLS session and both wait forever; this is what
    /// hung the demo's node -> control-plane check once on a loaded machine.)
    #[tokio::test]
    async fn a_request_written_while_the_socket_would_block_still_reaches_a_tls_peer() {
        let (connector, acceptor) = tls_pair();
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let mut tls = acceptor.accept(server_io).await.unwrap();
            let mut request = [0u8; 7];
            tls.read_exact(&mut request).await.unwrap();
            assert_eq!(&request, b"request");
            send_all(&mut tls, b"answer").await.unwrap();
            tls.shutdown().await.unwrap();
        });
        let io = BlocksOnce { inner: client_io, armed: false, blocked: false };
        let name = rustls_pki_types::ServerName::try_from("peer.test").unwrap();
        let mut tls = connector.connect(name, io).await.unwrap();
        // The request's first write attempt blocks.
        tls.get_mut().0.armed = true;
        let exchange = async {
            send_all(&mut tls, b"request").await.unwrap();
            let mut answer = String::new();
            tls.read_to_string(&mut answer).await.unwrap();
            answer
        };
        let answer = tokio::time::timeout(Duration::from_secs(10), exchange).await;
        assert_eq!(answer.as_deref().ok(), Some("answer"), "the request never reached the server");
        assert!(tls.get_ref().0.blocked, "the request's write would have blocked");
        server.await.unwrap();
    }
}
