"""The Pod Security Standards' `restricted` profile as a function: `violations(pod_spec)` lists what the
PodSecurity admission controller would refuse in a namespace labelled `pod-security.kubernetes.io/enforce:
restricted` (https://kubernetes.io/docs/concepts/security/pod-security-standards/, policy version v1.29), each
line naming the field. No library here implements the controller's checks, so they are written out from that page.

Baseline controls (restricted includes them):
- HostProcess: `securityContext.windowsOptions.hostProcess` unset or false (pod and every container);
- Host Namespaces: `hostNetwork`, `hostPID`, `hostIPC` unset or false;
- Privileged Containers: `securityContext.privileged` unset or false;
- Capabilities: `capabilities.add` only from the baseline list (subsumed by restricted's rule below);
- HostPath Volumes: no `hostPath` volume;
- Host Ports: `ports[].hostPort` unset or 0;
- AppArmor: the profile annotation or `appArmorProfile.type` only RuntimeDefault or Localhost;
- SELinux: `seLinuxOptions.type` unset or container_t / container_init_t / container_kvm_t, `user` and `role`
  unset;
- /proc Mount Type: `procMount` unset or Default;
- Seccomp: `seccompProfile.type` not Unconfined;
- Sysctls: only the safe set (kernel.shm_rmid_forced, net.ipv4.ip_local_port_range,
  net.ipv4.ip_unprivileged_port_start, net.ipv4.tcp_syncookies, net.ipv4.ping_group_range).
Restricted controls:
- Volume Types: only configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret;
- Privilege Escalation: `allowPrivilegeEscalation` false in every container;
- Running as Non-root: `runAsNonRoot` true on the pod, or on every container (a container may not set false);
- Running as Non-root user: `runAsUser` unset or non-zero;
- Seccomp: `seccompProfile.type` RuntimeDefault or Localhost on the pod, or on every container;
- Capabilities: every container drops ALL and adds at most NET_BIND_SERVICE.
Containers means `containers`, `initContainers` and `ephemeralContainers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(pod: Mapping[str, Any]):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate(pod.get(kind) or []):
            yield f"{kind}[{i}]", container


def _common(where: str, ctx: Mapping[str, Any], out: list[str]) -> None:
    """Controls that apply to the pod's and each container's securityContext alike."""
    if (ctx.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}.windowsOptions.hostProcess: must not be true")
    selinux = ctx.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        out.append(f"{where}.seLinuxOptions.type: {selinux['type']!r} is not allowed")
    for key in ("user", "role"):
        if selinux.get(key):
            out.append(f"{where}.seLinuxOptions.{key}: must be unset")
    if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.seccompProfile.type: must not be Unconfined")
    if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.appArmorProfile.type: must not be Unconfined")
    if ctx.get("runAsUser") == 0:
        out.append(f"{where}.runAsUser: must not be 0")


def violations(pod: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    """What `restricted` refuses in a pod spec (and its template's annotations), one line per field."""
    out: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"spec.{key}: must not be true")
    pod_ctx = pod.get("securityContext") or {}
    _common("spec.securityContext", pod_ctx, out)
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls: {sysctl.get('name')!r} is not a safe sysctl")
    for i, volume in enumerate(pod.get("volumes") or []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            out.append(f"spec.volumes[{i}].hostPath: hostPath volumes are not allowed")
        elif not kinds <= RESTRICTED_VOLUMES:
            out.append(f"spec.volumes[{i}]: volume type {', '.join(sorted(kinds))} is not allowed")
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"metadata.annotations[{key}]: {value!r} is not allowed")
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for where, container in _containers(pod):
        ctx = container.get("securityContext") or {}
        where = f"spec.{where}"
        _common(f"{where}.securityContext", ctx, out)
        if ctx.get("privileged"):
            out.append(f"{where}.securityContext.privileged: must not be true")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{where}.securityContext.procMount: must be Default")
        for j, port in enumerate(container.get("ports") or []):
            if port.get("hostPort"):
                out.append(f"{where}.ports[{j}].hostPort: must be unset or 0")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}.securityContext.allowPrivilegeEscalation: must be false")
        non_root = ctx.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{where}.securityContext.runAsNonRoot: must be true (here or on the pod)")
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp):
            out.append(f"{where}.securityContext.seccompProfile.type: must be RuntimeDefault or Localhost "
                       "(here or on the pod)")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}.securityContext.capabilities.drop: must include ALL")
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}.securityContext.capabilities.add: only NET_BIND_SERVICE may be added, not "
                       + ", ".join(sorted(added - {"NET_BIND_SERVICE"})))
    return out


def pod_templates(objects):
    """(object, pod spec, template annotations) for every planned object that carries a pod template."""
    for obj in objects:
        template = (obj.get("spec") or {}).get("template")
        if isinstance(template, Mapping) and "spec" in template:
            yield obj, template["spec"], (template.get("metadata") or {}).get("annotations") or {}
