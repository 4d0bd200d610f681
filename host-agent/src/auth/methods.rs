//! The scope each gRPC method needs: the one table every call passes
//! through. A method missing here is refused (there is no arm that lets an
//! unknown path through), and a test checks that every method of the
//! `hostagent.v1` services is listed.

use super::Scope;

/// What a method needs from its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone who can connect (the standard health check).
    Open,
    /// An identified caller holding this scope.
    Needs(Scope),
    /// Not a method host-agent serves: refused.
    Unknown,
}

/// The access rule of the gRPC method at `path` (`/package.Service/Method`).
pub fn required(path: &str) -> Access {
    use Access::{Needs, Open, Unknown};
    use Scope::{Admin, Read, Sessions};
    let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
        return Unknown;
    };
    match service {
        "hostagent.v1.Images" => match method {
            "RegisterImage" | "BuildGoldenSnapshot" | "DeleteImage" => Needs(Admin),
            "GetImage" | "ListImages" => Needs(Read),
            _ => Unknown,
        },
        "hostagent.v1.Sessions" => match method {
            "GetSession" | "ListSessions" => Needs(Read),
            "CreateSession"
            | "PauseSession"
            | "ResumeSession"
            | "SnapshotSession"
            | "ForkSession"
            | "RestoreSession"
            | "StopSession"
            | "DeleteSession"
            | "UpdateSessionNetwork"
            | "ExposePort"
            | "UnexposePort" => Needs(Sessions),
            _ => Unknown,
        },
        "hostagent.v1.Exec" => match method {
            "Exec" | "EndTurn" | "Attach" => Needs(Sessions),
            "ListExecs" => Needs(Read),
            _ => Unknown,
        },
        "hostagent.v1.Approvals" => match method {
            "ListAsks" | "ListAudit" => Needs(Read),
            "Answer" => Needs(Sessions),
            _ => Unknown,
        },
        "hostagent.v1.Files" => match method {
            // Reading a file shows what a command could print: Exec's scope.
            "Stat" | "List" | "Read" | "Write" | "MakeDir" | "Remove" | "Rename" | "Watch" => {
                Needs(Sessions)
            }
            _ => Unknown,
        },
        "hostagent.v1.Events" => match method {
            "Watch" => Needs(Read),
            _ => Unknown,
        },
        "hostagent.v1.Usage" => match method {
            "ListUsage" => Needs(Read),
            _ => Unknown,
        },
        // The node's snapshot storage, every session's layers included.
        "hostagent.v1.Snapshots" => match method {
            "ListLayers" | "CollectGarbage" => Needs(Admin),
            _ => Unknown,
        },
        "hostagent.v1.Schedules" => match method {
            "GetSchedule"
            | "ListSchedules"
            | "ListRuns"
            | "GetTrigger"
            | "ListTriggers"
            | "ListTriggerDeliveries" => Needs(Read),
            "CreateSchedule" | "UpdateSchedule" | "DeleteSchedule" | "RunScheduleNow"
            | "CreateTrigger" | "DeleteTrigger" => Needs(Sessions),
            _ => Unknown,
        },
        // Pushing and pulling change the fleet's and the node's images;
        // moving a session is a call on the caller's own session.
        "hostagent.v1.Fleet" => match method {
            "ListNodes" => Needs(Read),
            "PushImage" | "PullImage" => Needs(Admin),
            "MoveSession" => Needs(Sessions),
            _ => Unknown,
        },
        "hostagent.v1.Node" => match method {
            "GetCapacity" | "GetVersion" => Needs(Read),
            _ => Unknown,
        },
        "grpc.health.v1.Health" => match method {
            "Check" | "Watch" => Open,
            _ => Unknown,
        },
        "grpc.reflection.v1.ServerReflection" => match method {
            "ServerReflectionInfo" => Needs(Read),
            _ => Unknown,
        },
        _ => Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API definition this crate is built from.
    const PROTO: &str = concat!(
        include_str!("../../../proto/proto/hostagent.proto"),
        include_str!("../../../proto/proto/fleet.proto")
    );

    #[test]
    fn every_method_of_the_api_has_a_rule() {
        let package = PROTO
            .lines()
            .filter_map(|l| l.trim().strip_prefix("package "))
            .reduce(|a, b| {
                assert_eq!(a, b, "every file is of one package");
                a
            })
            .and_then(|p| p.strip_suffix(';'))
            .expect("package line");
        let mut service = None;
        let mut n = 0;
        for line in PROTO.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("service ") {
                service = rest.split_whitespace().next();
            } else if let Some(rest) = line.strip_prefix("rpc ") {
                let method = rest.split('(').next().expect("rpc name").trim();
                let svc = service.expect("rpc inside a service");
                let path = format!("/{package}.{svc}/{method}");
                assert_ne!(required(&path), Access::Unknown, "{path} has no rule");
                n += 1;
            }
        }
        assert!(n >= 25, "only {n} methods found");
    }

    #[test]
    fn unknown_paths_are_refused() {
        for p in [
            "",
            "/",
            "/hostagent.v1.Images",
            "/hostagent.v1.Images/Nope",
            "/hostagent.v1.Nope/GetImage",
            "hostagent.v1.Images/GetImage",
        ] {
            assert_eq!(required(p), Access::Unknown, "{p:?}");
        }
        assert_eq!(
            required("/hostagent.v1.Images/RegisterImage"),
            Access::Needs(Scope::Admin)
        );
        assert_eq!(required("/grpc.health.v1.Health/Check"), Access::Open);
    }
}
