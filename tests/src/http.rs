//! Just enough HTTP/1.x for the lab: framing by `Content-Length`, keep-alive,
//! and the `X-Backend` header that names the server which answered.
//!
//! Parsing works on byte buffers and never does I/O, so the async server, the
//! async load generator and the blocking test clients share it.

use std::io::{Read, Write};

use anyhow::{Context, Result, bail, ensure};

/// Response header naming the backend that served the request.
pub const BACKEND_HEADER: &str = "X-Backend";
/// Largest request or response head accepted; a peer sending more is broken.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Largest body accepted, so a bad length cannot make us allocate without bound.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// Read size used while waiting for a complete message.
const READ_CHUNK: usize = 16 * 1024;

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub keep_alive: bool,
    pub body: Vec<u8>,
}

/// A parsed response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Value of the [`BACKEND_HEADER`] header, if present.
    pub backend: Option<String>,
    pub keep_alive: bool,
    pub body: Vec<u8>,
}

/// The head of a message: start line plus the headers the lab cares about.
struct Head<'a> {
    start_line: &'a str,
    content_length: Option<usize>,
    connection: Option<String>,
    backend: Option<String>,
    /// Bytes of the head including the blank line.
    len: usize,
}

/// Splits the head off `buf`; `Ok(None)` while it is still incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<Head<'_>>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        ensure!(
            buf.len() <= MAX_HEAD_BYTES,
            "HTTP head longer than {MAX_HEAD_BYTES} bytes"
        );
        return Ok(None);
    };
    let text = std::str::from_utf8(&buf[..end]).context("HTTP head is not UTF-8")?;
    let mut lines = text.split("\r\n");
    let start_line = lines.next().unwrap_or_default();
    let mut head = Head {
        start_line,
        content_length: None,
        connection: None,
        backend: None,
        len: end + 4,
    };
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .with_context(|| format!("malformed HTTP header line {line:?}"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let len: usize = value.parse().context("bad Content-Length")?;
            ensure!(
                len <= MAX_BODY_BYTES,
                "Content-Length {len} exceeds {MAX_BODY_BYTES}"
            );
            head.content_length = Some(len);
        } else if name.eq_ignore_ascii_case("connection") {
            head.connection = Some(value.to_ascii_lowercase());
        } else if name.eq_ignore_ascii_case(BACKEND_HEADER) {
            head.backend = Some(value.to_string());
        }
    }
    Ok(Some(head))
}

/// HTTP/1.1 keeps the connection by default, HTTP/1.0 closes it.
fn keep_alive(version: &str, connection: Option<&str>) -> bool {
    match connection {
        Some("close") => false,
        Some("keep-alive") => true,
        _ => version == "HTTP/1.1",
    }
}

/// Returns the body and the total message length once the whole message is in `buf`.
fn take_body(buf: &[u8], head_len: usize, body_len: usize) -> Option<(Vec<u8>, usize)> {
    let total = head_len + body_len;
    (buf.len() >= total).then(|| (buf[head_len..total].to_vec(), total))
}

/// Parses one request from the front of `buf`: `Ok(None)` while incomplete,
/// else the request and how many bytes it used.
pub fn parse_request(buf: &[u8]) -> Result<Option<(Request, usize)>> {
    let Some(head) = parse_head(buf)? else {
        return Ok(None);
    };
    let mut parts = head.start_line.split(' ');
    let (Some(method), Some(path), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        bail!("malformed request line {:?}", head.start_line);
    };
    ensure!(
        version.starts_with("HTTP/1."),
        "unsupported version {version:?}"
    );
    let Some((body, used)) = take_body(buf, head.len, head.content_length.unwrap_or(0)) else {
        return Ok(None);
    };
    let request = Request {
        method: method.to_string(),
        path: path.to_string(),
        keep_alive: keep_alive(version, head.connection.as_deref()),
        body,
    };
    Ok(Some((request, used)))
}

/// Parses one response from the front of `buf`, like [`parse_request`].
/// The lab's server always sends `Content-Length`, so it is required.
pub fn parse_response(buf: &[u8]) -> Result<Option<(Response, usize)>> {
    let Some(head) = parse_head(buf)? else {
        return Ok(None);
    };
    let mut parts = head.start_line.splitn(3, ' ');
    let (Some(version), Some(status)) = (parts.next(), parts.next()) else {
        bail!("malformed status line {:?}", head.start_line);
    };
    ensure!(
        version.starts_with("HTTP/1."),
        "unsupported version {version:?}"
    );
    let status: u16 = status.parse().context("bad status code")?;
    let body_len = head
        .content_length
        .context("response without Content-Length")?;
    let Some((body, used)) = take_body(buf, head.len, body_len) else {
        return Ok(None);
    };
    let response = Response {
        status,
        backend: head.backend,
        keep_alive: keep_alive(version, head.connection.as_deref()),
        body,
    };
    Ok(Some((response, used)))
}

/// Serialises a request; a body makes it a POST-style request with a length.
pub fn encode_request(method: &str, path: &str, body: &[u8], keep_alive: bool) -> Vec<u8> {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let mut out = format!(
        "{method} {path} HTTP/1.1\r\nHost: lab\r\nConnection: {connection}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// Serialises a response carrying the backend's name.
pub fn encode_response(status: u16, backend: &str, body: &[u8], keep_alive: bool) -> Vec<u8> {
    let reason = if status == 200 { "OK" } else { "Error" };
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\n{BACKEND_HEADER}: {backend}\r\nConnection: {connection}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// Sends `request` on a blocking stream and reads exactly one response.
/// For tests, which hold long-lived connections across balancer restarts.
pub fn blocking_exchange<S: Read + Write>(stream: &mut S, request: &[u8]) -> Result<Response> {
    stream.write_all(request).context("sending the request")?;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    loop {
        if let Some((response, _)) = parse_response(&buf)? {
            return Ok(response);
        }
        let n = stream.read(&mut chunk).context("reading the response")?;
        ensure!(
            n > 0,
            "connection closed after {} bytes of response",
            buf.len()
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip_waits_for_the_whole_body() {
        let bytes = encode_request("POST", "/echo", b"hello", true);
        assert!(parse_request(&bytes[..bytes.len() - 1]).unwrap().is_none());
        let (request, used) = parse_request(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, "/echo");
        assert!(request.keep_alive);
        assert_eq!(request.body, b"hello");
    }

    #[test]
    fn response_round_trip_carries_the_backend_name() {
        let mut bytes = encode_response(200, "be1", b"body", false);
        bytes.extend_from_slice(b"trailing");
        let (response, used) = parse_response(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len() - b"trailing".len());
        assert_eq!(response.status, 200);
        assert_eq!(response.backend.as_deref(), Some("be1"));
        assert!(!response.keep_alive);
        assert_eq!(response.body, b"body");
    }

    #[test]
    fn rejects_garbage_and_oversized_lengths() {
        assert!(parse_request(b"NOT HTTP\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n\r\n").is_err());
    }

    #[test]
    fn http_1_0_closes_by_default() {
        let (request, _) = parse_request(b"GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert!(!request.keep_alive);
    }
}
