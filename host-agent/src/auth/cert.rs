//! The subject common name (CN) of a client certificate, read from its DER
//! encoding. The certificate has already been verified against `tls.ca` by
//! the TLS layer; this only walks `Certificate → tbsCertificate → subject`
//! with bounds-checked reads and takes the one CN attribute.

/// DER tags used here.
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
/// `[0] EXPLICIT Version` of tbsCertificate.
const VERSION: u8 = 0xa0;
/// id-at-commonName, 2.5.4.3.
const CN_OID: &[u8] = &[0x55, 0x04, 0x03];

/// One DER element at the start of `b`: (tag, contents, what follows).
fn element(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        // Indefinite (0) lengths are not DER; more than 4 bytes is not a certificate.
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n]
            .iter()
            .fold(0usize, |acc, &x| (acc << 8) | usize::from(x));
        b = &b[n..];
        len
    };
    if b.len() < len {
        return None;
    }
    Some((tag, &b[..len], &b[len..]))
}

/// The contents of the element with `tag` at the start of `b`, and the rest.
fn expect(b: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (t, inner, rest) = element(b)?;
    (t == tag).then_some((inner, rest))
}

/// The subject CN of the DER certificate `der`; `None` when the certificate
/// cannot be read, has no CN, or has more than one.
pub fn subject_cn(der: &[u8]) -> Option<String> {
    let (cert, _) = expect(der, SEQUENCE)?;
    let (tbs, _) = expect(cert, SEQUENCE)?;
    let mut rest = tbs;
    if let Some((VERSION, _, after)) = element(rest) {
        rest = after;
    }
    // serialNumber, signature, issuer, validity, then subject.
    for _ in 0..4 {
        rest = element(rest)?.2;
    }
    let (mut subject, _) = expect(rest, SEQUENCE)?;
    let mut cn = None;
    while !subject.is_empty() {
        let (mut rdn, next) = expect(subject, SET)?;
        subject = next;
        while !rdn.is_empty() {
            let (attr, next) = expect(rdn, SEQUENCE)?;
            rdn = next;
            let (oid, value) = expect(attr, OID)?;
            if oid != CN_OID {
                continue;
            }
            let (tag, text, _) = element(value)?;
            // UTF8String, PrintableString, IA5String.
            if !matches!(tag, 0x0c | 0x13 | 0x16) || cn.is_some() {
                return None;
            }
            cn = Some(String::from_utf8(text.to_vec()).ok()?);
        }
    }
    cn
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openssl req -x509 -subj "/O=Example Org/CN=ops-bot/OU=platform"`, DER.
    const CERT: &[&str] = &[
    "308201cc30820171a0030201020214614d5a549815dea76034d0426dd0f72aeb02ea02300a06082a8648ce3d04030230",
    "3b31143012060355040a0c0b4578616d706c65204f72673110300e06035504030c076f70732d626f743111300f060355",
    "040b0c08706c6174666f726d301e170d3236313230313032313134315a170d3336313132383032313134315a303b3114",
    "3012060355040a0c0b4578616d706c65204f72673110300e06035504030c076f70732d626f743111300f060355040b0c",
    "08706c6174666f726d3059301306072a8648ce3d020106082a8648ce3d0301070342000447f80553710e1ed638d17f17",
    "9c88076f420275d4bd0889b00f182af655b46e6f61637289fba0d4daa070adf8b645d83793e44fc42c6cdfced06bb680",
    "980af5d2a3533051301d0603551d0e041604145ed3fcce63fa304e85f5b89cd31e2831fe471705301f0603551d230418",
    "301680145ed3fcce63fa304e85f5b89cd31e2831fe471705300f0603551d130101ff040530030101ff300a06082a8648",
    "ce3d0403020349003046022100a91660bca106cb945dbc73ac1bcd0ce465e9db6c2dd2bff8c24b6712c0c5f7dc022100",
    "f877fca1a8bef1a39b49201ec227f3bf151150609891d3cf453294936f357bf0",    ];

    fn cert() -> Vec<u8> {
        hex::decode(CERT.concat()).unwrap()
    }

    #[test]
    fn the_subject_cn_is_found_among_other_attributes() {
        assert_eq!(subject_cn(&cert()).as_deref(), Some("ops-bot"));
    }

    #[test]
    fn truncated_or_garbage_input_gives_none() {
        let der = cert();
        for n in [0, 1, 2, 10, 100, der.len() - 1] {
            assert_eq!(subject_cn(&der[..n]), None, "first {n} bytes");
        }
        assert_eq!(subject_cn(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(subject_cn(&[0x30, 0x80, 0x00, 0x00]), None);
    }
}
