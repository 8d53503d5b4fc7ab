//! PROXY protocol v1 and v2 (HAProxy's specification), as sent by L4 load balancers in front of
//! the agent endpoint, so logs show the agent's real address. The header is read exactly, never
//! into the TLS handshake that follows. Parsing is sans-IO and unit-tested.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::io::{AsyncRead, AsyncReadExt};

/// The 12-byte signature that starts a v2 header.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Longest v1 header, CRLF included.
pub const V1_MAX: usize = 107;
/// Longest v2 address block accepted (addresses plus TLVs).
pub const V2_MAX_BODY: usize = 1024;

/// Why a PROXY header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyHeaderError {
    /// The connection does not start with a PROXY header.
    #[error("connection does not start with a PROXY protocol header")]
    Missing,
    /// The header is malformed.
    #[error("malformed PROXY protocol header: {0}")]
    Malformed(&'static str),
    /// Reading failed.
    #[error("reading the PROXY protocol header failed: {0}")]
    Io(String),
}

/// Parses a complete v1 line (`PROXY TCP4 src dst sport dport\r\n`); `None` for `UNKNOWN`.
pub fn parse_v1(line: &[u8]) -> Result<Option<SocketAddr>, ProxyHeaderError> {
    let text = std::str::from_utf8(line).map_err(|_| ProxyHeaderError::Malformed("v1 header is not ASCII"))?;
    let text = text.strip_suffix("\r\n").ok_or(ProxyHeaderError::Malformed("v1 header does not end in CRLF"))?;
    let mut fields = text.split(' ');
    if fields.next() != Some("PROXY") {
        return Err(ProxyHeaderError::Missing);
    }
    match fields.next() {
        Some("UNKNOWN") => Ok(None),
        Some(family @ ("TCP4" | "TCP6")) => {
            let source: IpAddr = fields
                .next()
                .and_then(|s| s.parse().ok())
                .ok_or(ProxyHeaderError::Malformed("bad v1 source address"))?;
            let _destination: IpAddr = fields
                .next()
                .and_then(|s| s.parse().ok())
                .ok_or(ProxyHeaderError::Malformed("bad v1 destination address"))?;
            let port: u16 =
                fields.next().and_then(|s| s.parse().ok()).ok_or(ProxyHeaderError::Malformed("bad v1 source port"))?;
            let _dport: u16 = fields
                .next()
                .and_then(|s| s.parse().ok())
                .ok_or(ProxyHeaderError::Malformed("bad v1 destination port"))?;
            if fields.next().is_some() || (family == "TCP4") != source.is_ipv4() {
                return Err(ProxyHeaderError::Malformed("v1 fields do not match the family"));
            }
            Ok(Some(SocketAddr::new(source, port)))
        }
        _ => Err(ProxyHeaderError::Malformed("unknown v1 protocol family")),
    }
}

/// Parses a v2 header's fixed part (16 bytes): returns the body length.
pub fn parse_v2_prefix(prefix: &[u8; 16]) -> Result<usize, ProxyHeaderError> {
    if prefix[..12] != V2_SIGNATURE {
        return Err(ProxyHeaderError::Missing);
    }
    if prefix[12] >> 4 != 2 {
        return Err(ProxyHeaderError::Malformed("unsupported v2 version"));
    }
    let len = usize::from(u16::from_be_bytes([prefix[14], prefix[15]]));
    if len > V2_MAX_BODY {
        return Err(ProxyHeaderError::Malformed("v2 header too long"));
    }
    Ok(len)
}

/// Parses a v2 body given the fixed part: `None` for LOCAL or non-IP families.
pub fn parse_v2_body(prefix: &[u8; 16], body: &[u8]) -> Result<Option<SocketAddr>, ProxyHeaderError> {
    let command = prefix[12] & 0x0f;
    match command {
        0 => return Ok(None),
        1 => {}
        _ => return Err(ProxyHeaderError::Malformed("unknown v2 command")),
    }
    match prefix[13] {
        // TCP over IPv4: src(4) dst(4) sport(2) dport(2).
        0x11 => {
            let b = body.get(..12).ok_or(ProxyHeaderError::Malformed("v2 IPv4 block too short"))?;
            let ip = Ipv4Addr::new(b[0], b[1], b[2], b[3]);
            Ok(Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be_bytes([b[8], b[9]]))))
        }
        // TCP over IPv6: src(16) dst(16) sport(2) dport(2).
        0x21 => {
            let b = body.get(..36).ok_or(ProxyHeaderError::Malformed("v2 IPv6 block too short"))?;
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&b[..16]);
            Ok(Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(octets)), u16::from_be_bytes([b[32], b[33]]))))
        }
        _ => Ok(None),
    }
}

/// Reads one PROXY header (v1 or v2) from the start of a connection, consuming exactly its
/// bytes. Returns the original client address when the header carries one.
pub async fn read_header<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Option<SocketAddr>, ProxyHeaderError> {
    let io = |e: std::io::Error| ProxyHeaderError::Io(e.to_string());
    // A v1 header is at least 15 bytes, a v2 header at least 16: 12 bytes are always safe to read.
    let mut start = [0u8; 12];
    reader.read_exact(&mut start).await.map_err(io)?;
    if start == V2_SIGNATURE {
        let mut prefix = [0u8; 16];
        prefix[..12].copy_from_slice(&start);
        reader.read_exact(&mut prefix[12..]).await.map_err(io)?;
        let len = parse_v2_prefix(&prefix)?;
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body).await.map_err(io)?;
        return parse_v2_body(&prefix, &body);
    }
    if !start.starts_with(b"PROXY ") {
        return Err(ProxyHeaderError::Missing);
    }
    let mut line = start.to_vec();
    while !line.ends_with(b"\r\n") {
        if line.len() >= V1_MAX {
            return Err(ProxyHeaderError::Malformed("v1 header longer than 107 bytes"));
        }
        let mut byte = [0u8; 1];
        reader.read_exact(&mut byte).await.map_err(io)?;
        line.push(byte[0]);
    }
    parse_v1(&line)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read(bytes: &[u8]) -> (Result<Option<SocketAddr>, ProxyHeaderError>, Vec<u8>) {
        let mut cursor = std::io::Cursor::new(bytes.to_vec());
        let result = read_header(&mut cursor).await;
        let rest = bytes[cursor.position() as usize..].to_vec();
        (result, rest)
    }

    #[tokio::test]
    async fn v1_headers_give_the_client_and_leave_the_tls_bytes() {
        let (result, rest) = read(b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n\x16\x03\x01").await;
        assert_eq!(result, Ok(Some("203.0.113.7:51234".parse().unwrap())));
        assert_eq!(rest, b"\x16\x03\x01");
        let (result, _) = read(b"PROXY TCP6 2001:db8::7 2001:db8::1 4000 443\r\n").await;
        assert_eq!(result, Ok(Some("[2001:db8::7]:4000".parse().unwrap())));
        let (result, rest) = read(b"PROXY UNKNOWN\r\nrest").await;
        assert_eq!((result, rest.as_slice()), (Ok(None), &b"rest"[..]));
    }

    #[tokio::test]
    async fn v2_headers_with_tlvs_give_the_client() {
        let mut header = V2_SIGNATURE.to_vec();
        header.extend_from_slice(&[0x21, 0x11, 0x00, 12 + 7]);
        header.extend_from_slice(&[198, 51, 100, 9, 10, 0, 0, 1, 0xc3, 0x50, 0x01, 0xbb]);
        header.extend_from_slice(&[0x04, 0x00, 0x04, b'a', b'b', b'c', b'd']); // a TLV, ignored
        header.extend_from_slice(b"\x16\x03");
        let (result, rest) = read(&header).await;
        assert_eq!(result, Ok(Some("198.51.100.9:50000".parse().unwrap())));
        assert_eq!(rest, b"\x16\x03");
        // LOCAL (health checks from the balancer itself): no address.
        let mut local = V2_SIGNATURE.to_vec();
        local.extend_from_slice(&[0x20, 0x00, 0x00, 0x00]);
        assert_eq!(read(&local).await.0, Ok(None));
    }

    #[tokio::test]
    async fn garbage_and_oversized_headers_are_refused() {
        assert_eq!(read(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x00").await.0, Err(ProxyHeaderError::Missing));
        let long = format!("PROXY TCP4 {}\r\n", "1".repeat(200));
        assert!(matches!(read(long.as_bytes()).await.0, Err(ProxyHeaderError::Malformed(_))));
        assert!(matches!(read(b"PROXY TCP4 1.2.3.4 5.6.7.8 1 99999\r\n").await.0, Err(ProxyHeaderError::Malformed(_))));
        assert!(matches!(read(b"PROXY TCP4 ::1 5.6.7.8 1 2\r\n").await.0, Err(ProxyHeaderError::Malformed(_))));
        let mut big = V2_SIGNATURE.to_vec();
        big.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert_eq!(read(&big).await.0, Err(ProxyHeaderError::Malformed("v2 header too long")));
        let mut random = fastrand::Rng::with_seed(9);
        for _ in 0..2000 {
            let mut bytes: Vec<u8> = (0..random.usize(0..64)).map(|_| random.u8(..)).collect();
            if random.bool() {
                let mut with_sig = V2_SIGNATURE.to_vec();
                with_sig.append(&mut bytes);
                bytes = with_sig;
            }
            let _ = read(&bytes).await;
        }
    }
}
