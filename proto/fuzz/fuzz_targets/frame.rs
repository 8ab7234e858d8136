//! Fuzzes the frame decoder the way the daemon and clients use it: check a
//! buffer for whole frames, decode each as a request and as a response.
//! Whatever decodes must re-encode to a frame that decodes and re-encodes to
//! the same bytes (f32 NaNs make value equality the wrong test).

#![no_main]

use hkv_proto::{check_frame, FrameCheck, Request, Response, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = data;
    loop {
        let h = match check_frame(buf, 1 << 20) {
            Ok(FrameCheck::Ready(h)) => h,
            Ok(FrameCheck::Oversized(h)) => {
                assert!(h.body_len > 1 << 20);
                return;
            }
            Ok(FrameCheck::NeedMore) | Err(_) => return,
        };
        let end = HEADER_LEN + h.body_len as usize;
        let body = &buf[HEADER_LEN..end];
        if let Ok(req) = Request::decode(&h, body) {
            let once = req.encode(h.id);
            let Ok(FrameCheck::Ready(h2)) = check_frame(&once, u32::MAX) else { panic!("re-encoded request is not a frame") };
            let again = Request::decode(&h2, &once[HEADER_LEN..]).expect("re-encoded request decodes");
            assert_eq!(again.encode(h.id), once, "request encoding is not stable");
        }
        // Region requests (PROTOCOL.md, "Registered regions") round-trip too.
        if hkv_proto::region::is_region(&h) {
            if let Ok(req) = hkv_proto::region::RegionRequest::decode(&h, body) {
                let once = req.encode(h.id);
                let Ok(FrameCheck::Ready(h2)) = check_frame(&once, u32::MAX) else { panic!("re-encoded region request is not a frame") };
                let again = hkv_proto::region::RegionRequest::decode(&h2, &once[HEADER_LEN..]).expect("re-encoded region request decodes");
                assert_eq!(again, req, "region request encoding is not stable");
            }
        }
        if let Ok(resp) = Response::decode(&h, body) {
            let once = resp.encode(h.op, h.id);
            let Ok(FrameCheck::Ready(h2)) = check_frame(&once, u32::MAX) else { panic!("re-encoded response is not a frame") };
            if let Ok(again) = Response::decode(&h2, &once[HEADER_LEN..]) {
                assert_eq!(again.encode(h.op, h.id), once, "response encoding is not stable");
            }
        }
        buf = &buf[end..];
    }
});
