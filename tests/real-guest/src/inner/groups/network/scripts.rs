//! What the `network` scenarios put in the guest: the agent's rules and the
//! scripts committed in the test repository (run through host-agent's Exec).

pub(super) const RULES: &str = r#"---
description: the real-guest network scenarios' agent
permission:
  bash:
    "*": allow
---
# Networker
"#;

/// The guest's programs, committed in the repository under `net/` (run as
/// `bash net/X.sh` or `perl net/X.pl`, so that the session's rules decide a
/// plain command: a shell script given with `-c` that redirects to
/// `/dev/tcp` would need approval).
pub(super) const SCRIPTS: &[(&str, &str)] = &[
    ("net/dns.pl", DNS_QUERY),
    ("net/echo.pl", ECHO_SERVER),
    ("net/line.sh", LINE),
    ("net/meet.sh", MEET),
    ("net/try.sh", TRY),
    ("net/upload.sh", UPLOAD),
    ("net/download.sh", DOWNLOAD),
    ("net/pong.sh", PONG),
];

/// `bash net/line.sh HOST PORT TEXT`: sends a line, prints the answer line.
pub(super) const LINE: &str = r#"exec 3<>"/dev/tcp/$1/$2" || exit 1
echo "$3" >&3
read -r l <&3 || exit 1
echo "$l"
"#;

/// `bash net/meet.sh HOST PORT`: a line to the meeting point; prints its
/// answer and the guest's addresses.
pub(super) const MEET: &str = r#"exec 3<>"/dev/tcp/$1/$2" || exit 1
echo meet >&3
read -r l <&3 || exit 1
echo "$l $(hostname -I)"
"#;

/// `bash net/try.sh IP PORT`: net/line.sh by literal address within 20 s;
/// prints what happened and `rc=N` (124: timed out).
pub(super) const TRY: &str = r#"timeout 20 bash net/line.sh "$1" "$2" by-ip 2>&1
echo "rc=$?"
"#;

/// `bash net/upload.sh HOST PORT BYTES`: sends BYTES zeros.
pub(super) const UPLOAD: &str = r#"head -c "$3" /dev/zero > "/dev/tcp/$1/$2"
"#;

/// `bash net/download.sh HOST PORT`: prints how many bytes came.
pub(super) const DOWNLOAD: &str = r#"cat < "/dev/tcp/$1/$2" | wc -c
"#;

/// `bash net/pong.sh HOST PORT`: sends each line back until `done`.
pub(super) const PONG: &str = r#"exec 3<>"/dev/tcp/$1/$2" || exit 1
while read -r l <&3; do
  [ "$l" = done ] && break
  echo "$l" >&3
done
"#;

/// A DNS query by hand (UDP), straight to a server: `perl net/dns.pl NAME
/// SERVER [PORT [TYPE]]` (TYPE `A`, the default, or `AAAA`) prints
/// `rcode=N answers=A.B.C.D,...` (IPv6 answers as eight groups of four hex
/// digits).
pub(super) const DNS_QUERY: &str = r#"
use strict; use IO::Socket::INET;
my ($name, $server, $port, $qtype) = @ARGV; $port ||= 53;
my $qt = ($qtype || "A") eq "AAAA" ? 28 : 1;
my $q = pack("n6", 0x4242, 0x0100, 1, 0, 0, 0)
  . join("", map { chr(length $_) . $_ } split /\./, $name) . "\0" . pack("n2", $qt, 1);
my $s = IO::Socket::INET->new(PeerAddr => $server, PeerPort => $port, Proto => "udp")
  or die "socket: $!\n";
defined $s->send($q) or die "send: $!\n";
my $rin = ""; vec($rin, fileno($s), 1) = 1;
select($rin, undef, undef, 10) or die "no answer in 10 s\n";
my $r; defined $s->recv($r, 4096) or die "recv: $!\n";
my ($id, $flags, $qd, $an) = unpack("n4", $r);
my $off = 12;
for (1 .. $qd) { $off += ord(substr($r, $off, 1)) + 1 while ord(substr($r, $off, 1)); $off += 5; }
my @a;
for (1 .. $an) {
  if (ord(substr($r, $off, 1)) >= 0xc0) { $off += 2 }
  else { $off += ord(substr($r, $off, 1)) + 1 while ord(substr($r, $off, 1)); $off += 1 }
  my ($type, $class, $ttl, $len) = unpack("n2 N n", substr($r, $off, 10)); $off += 10;
  push @a, join(".", unpack("C4", substr($r, $off, 4))) if $type == 1 && $len == 4;
  push @a, join(":", unpack("(H4)8", substr($r, $off, 16))) if $type == 28 && $len == 16;
  $off += $len;
}
printf "id=%d rcode=%d answers=%s\n", $id, $flags & 15, join(",", @a);
"#;

/// `perl net/echo.pl PORT FILE`: a one-connection TCP echo server that also
/// keeps what it received in FILE.
pub(super) const ECHO_SERVER: &str = r#"
use strict; use IO::Socket::INET;
my ($port, $keep) = @ARGV;
my $l = IO::Socket::INET->new(LocalPort => $port, Listen => 1, ReuseAddr => 1, Proto => "tcp")
  or die "listen: $!\n";
my $c = $l->accept or die "accept: $!\n";
open(my $f, ">", $keep) or die "open: $!\n";
binmode $c; binmode $f;
my ($buf, $n, $total) = ("", 0, 0);
while (($n = sysread($c, $buf, 65536)) > 0) {
  print $f $buf;
  my $off = 0;
  while ($off < $n) { my $w = syswrite($c, $buf, $n - $off, $off); die "write: $!\n" unless defined $w; $off += $w; }
  $total += $n;
}
close $f; close $c;
print "echoed $total\n";
"#;
