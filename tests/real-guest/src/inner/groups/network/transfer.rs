//! The `network` scenarios that move data: an exposed guest port carrying
//! bytes both ways (`net-expose`), and throughput and latency between the
//! guest and the internet namespace (`net-throughput`).

use super::*;

/// (e) A port the guest listens on, exposed on the node: 1 MiB of random
/// bytes sent in and echoed back out, both checked by SHA-256.
pub fn expose(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, _name, s| {
        let (a, _) = parts(ctx)?;
        let ch = a.channel()?;
        let mut data = vec![0u8; EXPOSE_BYTES];
        getrandom::fill(&mut data).map_err(|e| format!("no randomness: {e}"))?;
        let sent = hex::encode(Sha256::digest(&data));
        let keep = "/tmp/rg-expose-in";
        let port = EXPOSED_PORT.to_string();
        let argv = ["timeout", "300", "perl", "net/echo.pl", &port, keep];
        let server = exec(ch.clone(), s, &argv);
        let client = async {
            let exposed = pb::sessions_client::SessionsClient::new(ch.clone())
                .expose_port(pb::ExposePortRequest {
                    session_id: s.session_id.clone(),
                    guest_port: u32::from(EXPOSED_PORT),
                    protocol: "tcp".into(),
                })
                .await
                .map_err(|e| format!("ExposePort: {}", e.message()))?
                .into_inner();
            let addr: SocketAddr = exposed
                .host_address
                .parse()
                .map_err(|_| format!("ExposePort gave {:?}", exposed.host_address))?;
            let data = data.clone();
            tokio::task::spawn_blocking(move || echo_through(addr, &data))
                .await
                .map_err(|e| e.to_string())?
                .map(|back| (addr, back))
        };
        let (server, client) = a.block_on(async { tokio::join!(server, client) });
        let (addr, back) = client?;
        let server = server?;
        expect_ok("the guest's echo server", &server)?;
        let echoed = hex::encode(Sha256::digest(&back));
        if back.len() != data.len() || echoed != sent {
            return Err(format!(
                "{} bytes came back (sha256 {echoed}), {} sent (sha256 {sent})",
                back.len(),
                data.len()
            ));
        }
        let r = run(a, &ch, s, &["sha256sum", keep])?;
        expect_ok("sha256sum in the guest", &r)?;
        let received = r.stdout.split_whitespace().next().unwrap_or_default();
        if received != sent {
            return Err(format!(
                "the guest received sha256 {received}, the node sent {sent}"
            ));
        }
        Ok(format!(
            "guest port {EXPOSED_PORT} at {addr}: {} KiB in (the guest's sha256 matches) and echoed back out (matches)",
            EXPOSE_BYTES >> 10
        ))
    })
}

/// Sends `data` to `addr` while reading what comes back, until the other
/// end closes; retries for up to 120 s while the guest's server is not
/// listening yet (host-agent closes the connection at once then).
fn echo_through(addr: SocketAddr, data: &[u8]) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    while Instant::now() < deadline {
        match echo_once(addr, data) {
            Ok(back) if !back.is_empty() => return Ok(back),
            Ok(_) => last = "closed with nothing back".into(),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    Err(format!("through {addr}: {last}"))
}

fn echo_once(addr: SocketAddr, data: &[u8]) -> Result<Vec<u8>, String> {
    let mut c =
        TcpStream::connect_timeout(&addr, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    c.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let mut w = c.try_clone().map_err(|e| e.to_string())?;
    let data = data.to_vec();
    let writer = std::thread::spawn(move || {
        let r = w.write_all(&data);
        let _ = w.shutdown(std::net::Shutdown::Write);
        r
    });
    let mut back = Vec::new();
    let read = c.read_to_end(&mut back);
    let wrote = writer
        .join()
        .map_err(|_| "the writer panicked".to_string())?;
    if back.is_empty() {
        return Err(format!(
            "nothing came back (write: {wrote:?}, read: {read:?})"
        ));
    }
    read.map_err(|e| format!("reading the echo: {e}"))?;
    wrote.map_err(|e| format!("writing: {e}"))?;
    Ok(back)
}

/// (f) Throughput each way and round-trip time between the guest and the
/// server, through virtio-net, the VM's namespace and the node (figures
/// printed; nothing asserted about them, only that the transfers complete).
pub fn throughput(ctx: &mut Ctx, name: &str) -> Check {
    scenario(ctx, name, |ctx, name, s| {
        let (a, net) = parts(ctx)?;
        let ch = a.channel()?;
        let sunk_before = net.internet.with(|s| s.sunk.len());
        let (port, bytes) = (SINK_PORT.to_string(), UPLOAD_BYTES.to_string());
        let r = run(
            a,
            &ch,
            s,
            &["bash", "net/upload.sh", ALLOWED_NAME, &port, &bytes],
        )?;
        expect_ok("the upload", &r)?;
        // The sink notes the transfer once it read the guest's EOF.
        let deadline = Instant::now() + Duration::from_secs(30);
        let up = loop {
            if let Some(t) = net.internet.with(|s| s.sunk.get(sunk_before).copied()) {
                break t;
            }
            if Instant::now() > deadline {
                return Err("the sink never saw the upload end".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if up.bytes != UPLOAD_BYTES {
            return Err(format!(
                "the sink received {} of {UPLOAD_BYTES} bytes",
                up.bytes
            ));
        }
        let sourced_before = net.internet.with(|s| s.sourced.len());
        let port = SOURCE_PORT.to_string();
        let r = run(a, &ch, s, &["bash", "net/download.sh", ALLOWED_NAME, &port])?;
        expect_ok("the download", &r)?;
        if r.stdout.trim() != SOURCE_BYTES.to_string() {
            return Err(format!(
                "the guest received {:?} of {SOURCE_BYTES} bytes",
                r.stdout.trim()
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let down = loop {
            if let Some(t) = net
                .internet
                .with(|s| s.sourced.get(sourced_before).copied())
            {
                break t;
            }
            if Instant::now() > deadline {
                return Err("the source never saw the download end".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let pings_before = net.internet.with(|s| s.pings.len());
        let port = PING_PORT.to_string();
        let r = run(a, &ch, s, &["bash", "net/pong.sh", ALLOWED_NAME, &port])?;
        expect_ok("the round trips", &r)?;
        let mut rtts = net
            .internet
            .with(|s| s.pings.get(pings_before).cloned())
            .ok_or("the ping server recorded nothing")?;
        if rtts.len() != internet::PING_ROUNDS {
            return Err(format!(
                "{} of {} round trips completed",
                rtts.len(),
                internet::PING_ROUNDS
            ));
        }
        rtts.sort_by(|x, y| x.total_cmp(y));
        let ms = |q: f64| rtts[((rtts.len() - 1) as f64 * q) as usize] * 1e3;
        let mib_s = |t: internet::Transfer| t.bytes as f64 / (1 << 20) as f64 / t.secs.max(1e-9);
        let text = format!(
            "guest->server {} MiB in {:.2} s = {:.1} MiB/s; server->guest {} MiB in {:.2} s = {:.1} MiB/s; TCP round trip (a line each way, bash in the guest) over {} rounds: min {:.2} ms, median {:.2} ms, p90 {:.2} ms (nested emulation: for orientation only)",
            up.bytes >> 20,
            up.secs,
            mib_s(up),
            down.bytes >> 20,
            down.secs,
            mib_s(down),
            rtts.len(),
            ms(0.0),
            ms(0.5),
            ms(0.9),
        );
        ctx.info(name, &text);
        Ok(text)
    })
}
