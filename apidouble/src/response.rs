//! The responses the double writes: JSON, text, and an API error as a
//! `Status` object (with `Retry-After` when it has one).

use std::convert::Infallible;

use bytes::Bytes;
use http::{header, Response};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use serde_json::Value;

use crate::status::ApiError;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed_unsync()
}

pub fn json_response(code: u16, v: &Value) -> Response<Body> {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(body))
        .expect("response")
}

pub fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.code, &e.to_status());
    if let Some(ra) = e.retry_after {
        r.headers_mut()
            .insert(header::RETRY_AFTER, ra.to_string().parse().expect("header"));
    }
    r
}

pub fn text_response(code: u16, t: &str) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(full(t.to_string()))
        .expect("response")
}
