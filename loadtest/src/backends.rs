//! Node-side servers for the demo, tests and load tests: echo, a tiny HTTP server, and a bulk
//! source/sink.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Echoes every byte back; end-of-stream from the client is answered with a write shutdown.
pub fn spawn_echo(listener: TcpListener) -> JoinHandle<()> {
    serve(listener, |mut stream| async move {
        let (mut read, mut write) = stream.split();
        let _ = tokio::io::copy(&mut read, &mut write).await;
        let _ = write.shutdown().await;
    })
}

/// Answers each connection's first HTTP request with `200 OK` and `hello from <name>`.
pub fn spawn_http(listener: TcpListener, name: String) -> JoinHandle<()> {
    serve(listener, move |mut stream| {
        let name = name.clone();
        async move {
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let path =
                std::str::from_utf8(&head).ok().and_then(|h| h.split_whitespace().nth(1)).unwrap_or("/").to_owned();
            let body = format!("hello from {name}: you asked for {path}\n");
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
    })
}

/// Bulk protocol: the client sends `D` + u64 (big-endian) to download that many pattern bytes,
/// or `U` then data until end-of-stream to upload; an upload is answered with the byte count.
pub fn spawn_bulk(listener: TcpListener) -> JoinHandle<()> {
    serve(listener, |mut stream| async move {
        let mut command = [0u8; 9];
        if stream.read_exact(&mut command[..1]).await.is_err() {
            return;
        }
        match command[0] {
            b'D' => {
                if stream.read_exact(&mut command[1..]).await.is_err() {
                    return;
                }
                let mut be = [0u8; 8];
                be.copy_from_slice(&command[1..]);
                let mut left = u64::from_be_bytes(be);
                let chunk = pattern(256 * 1024);
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
                let _ = stream.shutdown().await;
            }
            b'U' => {
                let mut buf = vec![0u8; 256 * 1024];
                let mut total: u64 = 0;
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) => break,
                        Ok(n) => total += n as u64,
                        Err(_) => return,
                    }
                }
                let _ = stream.write_all(&total.to_be_bytes()).await;
                let _ = stream.shutdown().await;
            }
            _ => {}
        }
    })
}

/// Deterministic bytes for bulk transfers.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8).collect()
}

fn serve<F, Fut>(listener: TcpListener, handler: F) -> JoinHandle<()>
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(handler(stream));
                }
                Err(e) if is_transient(&e) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                Err(_) => return,
            }
        }
    })
}

fn is_transient(e: &io::Error) -> bool {
    !matches!(e.kind(), io::ErrorKind::InvalidInput)
}
