//! The little HTTP/1.1 the bootstrap server and its client speak: one request per
//! connection (`Connection: close`), bodies sized by `Content-Length`, JSON. Parsing is
//! `httparse`'s; sizes are bounded on both ends.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::DiscoveryError;

/// Most header lines accepted in a request or response.
const MAX_HEADERS: usize = 32;

/// A parsed request.
#[derive(Debug)]
pub(crate) struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// `key=value` pairs of the query string, undecoded (`%` is never valid in our values).
    pub query: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The value of query parameter `name`, if present (the last one wins).
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request could not be read; each maps to the status the server answers with.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection failed or closed before a whole request arrived.
    Io(std::io::Error),
    /// Not HTTP/1.x, or a malformed header.
    Malformed(String),
    /// The head (request line + headers) is over the limit.
    HeadTooLarge,
    /// `Content-Length` is over the limit.
    BodyTooLarge,
    /// Chunked or other transfer codings.
    Unsupported(String),
}

impl ReadError {
    /// The status code and message of the answer.
    pub fn status(&self) -> (u16, String) {
        match self {
            ReadError::Io(e) => (400, format!("incomplete request: {e}")),
            ReadError::Malformed(m) => (400, format!("malformed request: {m}")),
            ReadError::HeadTooLarge => (431, "request head too large".into()),
            ReadError::BodyTooLarge => (413, "request body too large".into()),
            ReadError::Unsupported(m) => (501, m.clone()),
        }
    }
}

/// Reads one request: a head of at most `max_head` bytes, a body of at most `max_body`.
pub(crate) async fn read_request<R: AsyncRead + Unpin>(
    r: &mut R,
    max_head: usize,
    max_body: usize,
) -> Result<Request, ReadError> {
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let (head_len, method, target, content_length) = loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                let content_length = body_length(req.headers)?;
                break (
                    n,
                    req.method.unwrap_or_default().to_owned(),
                    req.path.unwrap_or_default().to_owned(),
                    content_length,
                );
            }
            Ok(httparse::Status::Partial) => {
                if buf.len() >= max_head {
                    return Err(ReadError::HeadTooLarge);
                }
            }
            Err(httparse::Error::TooManyHeaders) => return Err(ReadError::HeadTooLarge),
            Err(e) => return Err(ReadError::Malformed(e.to_string())),
        }
        let room = max_head - buf.len();
        let mut chunk = vec![0u8; room.min(4096)];
        let n = r.read(&mut chunk).await.map_err(ReadError::Io)?;
        if n == 0 {
            return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if content_length > max_body {
        return Err(ReadError::BodyTooLarge);
    }
    let mut body = buf.split_off(head_len);
    if body.len() > content_length {
        return Err(ReadError::Malformed(
            "more bytes than Content-Length (one request per connection)".into(),
        ));
    }
    let already = body.len();
    body.resize(content_length, 0);
    r.read_exact(&mut body[already..])
        .await
        .map_err(ReadError::Io)?;
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), parse_query(q)),
        None => (target, Vec::new()),
    };
    Ok(Request {
        method,
        path,
        query,
        body,
    })
}

/// The body length a head announces: `Content-Length` (0 if absent); transfer codings are
/// not supported.
fn body_length(headers: &[httparse::Header<'_>]) -> Result<usize, ReadError> {
    let mut length: Option<usize> = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(ReadError::Unsupported(
                "Transfer-Encoding is not supported; send Content-Length".into(),
            ));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| super::record::parse_decimal::<usize>(v.trim()))
                .ok_or_else(|| ReadError::Malformed("bad Content-Length".into()))?;
            if length.is_some_and(|l| l != v) {
                return Err(ReadError::Malformed("conflicting Content-Length".into()));
            }
            length = Some(v);
        }
    }
    Ok(length.unwrap_or(0))
}

fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (p.to_owned(), String::new()),
        })
        .collect()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Writes a whole response with a JSON body and `Connection: close`.
pub(crate) async fn write_response<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: u16,
    body: &[u8],
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        reason(status),
        body.len()
    );
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
    w.write_all(&out).await?;
    w.flush().await
}

/// One request from the client: connect to `server`, send, read the whole answer (at most
/// `max_response` bytes), all within `timeout`. Returns the status and the body.
pub(crate) async fn call(
    server: &str,
    method: &str,
    target: &str,
    body: Option<&[u8]>,
    timeout: Duration,
    max_response: usize,
) -> Result<(u16, Vec<u8>), DiscoveryError> {
    let what = format!("{method} http://{server}{target}");
    tokio::time::timeout(
        timeout,
        call_inner(server, method, target, body, max_response),
    )
    .await
    .map_err(|_| DiscoveryError::Timeout(what))?
}

async fn call_inner(
    server: &str,
    method: &str,
    target: &str,
    body: Option<&[u8]>,
    max_response: usize,
) -> Result<(u16, Vec<u8>), DiscoveryError> {
    let unreachable = |source| DiscoveryError::Unreachable {
        server: server.to_owned(),
        source,
    };
    let mut stream = TcpStream::connect(server).await.map_err(unreachable)?;
    let body = body.unwrap_or_default();
    let mut out = format!(
        "{method} {target} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    stream.write_all(&out).await.map_err(unreachable)?;
    let mut answer = Vec::new();
    (&mut stream)
        .take(max_response as u64 + 1)
        .read_to_end(&mut answer)
        .await
        .map_err(unreachable)?;
    if answer.len() > max_response {
        return Err(DiscoveryError::Protocol(format!(
            "answer over {max_response} bytes"
        )));
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(&answer) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return Err(DiscoveryError::Protocol("truncated answer".into()))
        }
        Err(e) => return Err(DiscoveryError::Protocol(format!("not HTTP: {e}"))),
    };
    let status = resp.code.unwrap_or_default();
    let length =
        body_length(resp.headers).map_err(|e| DiscoveryError::Protocol(format!("{e:?}")))?;
    let body = answer.split_off(head_len);
    if body.len() < length {
        return Err(DiscoveryError::Protocol("truncated body".into()));
    }
    Ok((status, body[..length].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> Result<Request, ReadError> {
        let mut r = bytes;
        read_request(&mut r, 256, 64).await
    }

    #[tokio::test]
    async fn requests() {
        let r = parse(b"PUT /v1/peers?a=1&b=&c HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
            .await
            .unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("PUT", "/v1/peers"));
        assert_eq!(r.param("a"), Some("1"));
        assert_eq!(r.param("b"), Some(""));
        assert_eq!(r.param("c"), Some(""));
        assert_eq!(r.body, b"{}");

        let status = |r: Result<Request, ReadError>| r.unwrap_err().status().0;
        assert_eq!(status(parse(b"\x00\xffgarbage\r\n\r\n").await), 400);
        assert_eq!(status(parse(b"GET / HTTP/1.1\r\n").await), 400, "eof");
        assert_eq!(
            status(parse(&[b'a'; 300]).await),
            431,
            "no end of head in sight"
        );
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(300));
        assert_eq!(status(parse(long.as_bytes()).await), 431);
        assert_eq!(
            status(parse(b"PUT / HTTP/1.1\r\nContent-Length: 65\r\n\r\n").await),
            413
        );
        assert_eq!(
            status(parse(b"PUT / HTTP/1.1\r\nContent-Length: x\r\n\r\n").await),
            400
        );
        assert_eq!(
            status(parse(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").await),
            501
        );
        assert_eq!(
            status(parse(b"PUT / HTTP/1.1\r\nContent-Length: 1\r\n\r\nab").await),
            400
        );
    }
}
