"""Tailnet: one Headscale control server and the operator's credentials for it."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, model_validator

from tailnet_operator.api.common import (
    CIDR,
    GO_DURATION_PATTERN,
    ApiModel,
    BoundedString,
    Conditions,
    DNSLabel,
    DNSName,
    DNSNameGlob,
    Generation,
    HttpURL,
    NamespacedName,
    ObjectMeta,
    SecretKey,
    SecretKeyRef,
    TagGlob,
    Timestamp,
    cel,
    cel_string,
    parse_go_duration,
    validations,
)

MIN_API_KEY_LIFETIME_SECONDS = 3600.0


class BootstrapKeySecretRef(SecretKeyRef):
    """The Secret key holding the bootstrap Headscale API key (a full admin key: Headscale keys have no scopes)."""

    key: SecretKey = Field(default="apiKey", description="Key within the Secret's data. Defaults to apiKey.")


class CASecretRef(SecretKeyRef):
    """A Secret key holding PEM CA certificates."""

    key: SecretKey = Field(default="ca.crt", description="Key within the Secret's data. Defaults to ca.crt.")


class TailnetDNS(ApiModel):
    """The DNS hosts file this Tailnet owns."""

    hosts_config_map: NamespacedName = Field(
        description=(
            "The CoreDNS hosts ConfigMap the operator owns and rewrites with every egress alias "
            "and ingress name of this Tailnet."
        )
    )
    zones: list[DNSName] = Field(
        min_length=1,
        max_length=16,
        description="DNS zones served from the hosts file, e.g. tailnet.example.internal.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class TailnetTenant(ApiModel):
    """Namespaces the cluster admin lets use this Tailnet, and what they may claim on it."""

    namespaces: list[DNSLabel] = Field(
        min_length=1,
        max_length=64,
        description="Namespaces whose TailnetIngresses may join this Tailnet.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    tags: list[TagGlob] = Field(
        min_length=1,
        max_length=32,
        description=(
            "Tags their ingresses may use: a tag, or a prefix ending in * (tag:shop-*). A tag that an "
            "egress, a gateway, a site or a grant source of the base policy uses is available only when "
            "listed here by its exact name, never through a prefix."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    dns_names: list[DNSNameGlob] | None = Field(
        default=None,
        alias="dnsNames",
        max_length=32,
        description=(
            "DNS names their ingresses may put in the hosts file (dnsTemplate names, host names and "
            "aliases): a name, or *. and a name for every name under it. Names must also lie in one of "
            "spec.dns.zones. Without this field the tenant gets no DNS names."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    shared_addresses: list[CIDR] | None = Field(
        default=None,
        max_length=16,
        description=(
            "Ranges their ingresses may take a sharedAddress from (the address an ingress's replicas share, "
            "advertised as a route): e.g. 198.18.5.0/28. An address belongs to the first ingress that "
            "claims it. Without this field the tenant gets no shared addresses, so its ingresses run one "
            "replica."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class PolicyConfigMapRef(NamespacedName):
    """A key in a ConfigMap holding the base HuJSON policy."""

    key: SecretKey = Field(
        default="policy.hujson", description="Key within the ConfigMap's data. Defaults to policy.hujson."
    )


class TailnetPolicy(ApiModel):
    """Hands the Headscale policy to the operator."""

    base_config_map_ref: PolicyConfigMapRef = Field(
        description=(
            "The base policy (HuJSON). The operator appends tagOwners, /32 approvals and grants "
            "derived from the CRs; entries in the base always win and nothing is removed."
        )
    )
    mode: Literal["Render", "Apply"] = Field(
        default="Render",
        description=(
            "Render publishes the rendered policy in a ConfigMap only; Apply also writes it to "
            "Headscale when the live policy differs. Defaults to Render."
        ),
    )


class TailnetSpec(ApiModel):
    """Desired state of a Tailnet."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.caBundle) && has(self.caSecretRef))",
                "set at most one of caBundle and caSecretRef",
                ".caSecretRef",
            ),
            cel(
                "(has(self.allowInsecureHTTP) && self.allowInsecureHTTP) || (self.loginURL.startsWith('https://')"
                " && (!has(self.apiURL) || self.apiURL.startsWith('https://')))",
                "loginURL and apiURL must be https:// URLs (agent keys and the operator's admin key travel "
                "over them); set allowInsecureHTTP: true only for a Headscale on a trusted network",
                ".loginURL",
            ),
        )
    )

    login_url: HttpURL = Field(
        alias="loginURL",
        description="URL of the Headscale server that agents use as their control server (--login-server).",
    )
    api_url: HttpURL | None = Field(
        default=None,
        alias="apiURL",
        description=(
            "URL the operator uses for the Headscale API, e.g. an in-cluster Service. Defaults to loginURL."
        ),
    )
    ca_bundle: str | None = Field(
        default=None,
        max_length=65536,
        description="PEM CA certificates to trust for loginURL and apiURL, for a private CA.",
        json_schema_extra=validations(
            cel("self.contains('-----BEGIN CERTIFICATE-----')", "must contain at least one PEM certificate")
        ),
    )
    ca_secret_ref: CASecretRef | None = Field(
        default=None, description="A Secret key with PEM CA certificates; an alternative to caBundle."
    )
    allow_insecure_http: bool | None = Field(
        default=None,
        alias="allowInsecureHTTP",
        description=(
            "Accept http:// in loginURL and apiURL: the operator's admin key and the agents' control "
            "traffic then cross the network in clear. The Tailnet reports a Warning condition "
            "InsecureTransport while it is set. Defaults to false."
        ),
    )
    bootstrap_key_secret_ref: BootstrapKeySecretRef = Field(
        description=(
            "The Secret key with a Headscale API key the operator uses only to mint and rotate its own "
            "working key; it must be in the operator's namespace. Headscale API keys have no scopes: "
            "this is a full admin key, so delete it once the Tailnet is Ready (the working key rotates "
            "on its own). The operator never writes this Secret."
        )
    )
    api_key_lifetime: str = Field(
        default="720h",
        max_length=32,
        pattern=GO_DURATION_PATTERN,
        description=(
            "Lifetime of the working API key as a Go duration (at least 1h); the key is rotated at "
            "half of it. Defaults to 720h."
        ),
        json_schema_extra=validations(
            cel(
                f"!self.matches({cel_string(GO_DURATION_PATTERN)}) || duration(self) >= duration('1h')",
                "must be at least 1h",
            )
        ),
    )
    reserved_networks: list[CIDR] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Networks no TailnetSite may overlap, such as the pod, service and node ranges "
            "(e.g. 10.96.0.0/12)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    dns: TailnetDNS | None = Field(
        default=None,
        description="The DNS hosts file this Tailnet owns. Without it no DNS entries are written.",
    )
    policy: TailnetPolicy | None = Field(
        default=None,
        description=(
            "Hands the Headscale policy to the operator. Without it the operator only reads the live "
            "policy and reports what is missing in status.policy."
        ),
    )
    tenants: list[TailnetTenant] | None = Field(
        default=None,
        max_length=256,
        description=(
            "The namespaces that may run TailnetIngresses on this Tailnet, each with the tags and DNS "
            "names it may use. A namespace named by no entry may use nothing: its ingresses are refused "
            "at admission and by the operator (Ready=False TenancyRefused), and no key is minted for them."
        ),
    )

    def cleartext_urls(self) -> list[tuple[str, str]]:
        """(field, URL) of each of loginURL and apiURL that is not https://."""
        return [(field, url) for field, url in (("loginURL", self.login_url), ("apiURL", self.api_url))
                if url is not None and not url.startswith("https://")]

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.ca_bundle is not None and self.ca_secret_ref is not None:
            raise ValueError("caSecretRef: set at most one of caBundle and caSecretRef")
        if self.ca_bundle is not None and "-----BEGIN CERTIFICATE-----" not in self.ca_bundle:
            raise ValueError("caBundle: must contain at least one PEM certificate")
        if parse_go_duration(self.api_key_lifetime) < MIN_API_KEY_LIFETIME_SECONDS:
            raise ValueError("apiKeyLifetime: must be at least 1h")
        cleartext = self.cleartext_urls()
        if cleartext and not self.allow_insecure_http:
            raise ValueError(f"{cleartext[0][0]}: must be an https:// URL (agent keys and the operator's admin key "
                             "travel over it); set allowInsecureHTTP: true only for a Headscale on a trusted network")
        return self


class APIKeyStatus(ApiModel):
    """The operator's current working API key (never the secret itself)."""

    id: str | None = Field(default=None, max_length=64, description="Headscale ID of the key.")
    prefix: str | None = Field(default=None, max_length=64, description="Public prefix of the key.")
    created_at: Timestamp | None = Field(default=None, description="When the key was created.")
    expires_at: Timestamp | None = Field(default=None, description="When the key expires.")
    next_rotation_at: Timestamp | None = Field(
        default=None, description="When the operator will mint the next key (half the lifetime)."
    )


class PolicyStatus(ApiModel):
    """What the operator rendered, applied or found missing in the Headscale policy."""

    rendered_hash: str | None = Field(
        default=None, max_length=128, description="Hash of the last rendered policy."
    )
    applied_hash: str | None = Field(
        default=None, max_length=128, description="Hash of the policy last written to Headscale (Apply mode)."
    )
    rendered_config_map: str | None = Field(
        default=None, max_length=253, description="Name of the ConfigMap holding the rendered policy."
    )
    missing: str | None = Field(
        default=None,
        max_length=65536,
        description=(
            "When the policy is not owned: a ready-to-paste HuJSON snippet with the tagOwners, "
            "autoApprovers and grants the CRs need but the live policy lacks."
        ),
    )
    missing_tags: list[BoundedString] | None = Field(
        default=None, max_length=256, description="Tags the CRs use that the live policy does not own."
    )
    skipped: list[SkippedPolicyEntry] | None = Field(
        default=None,
        max_length=64,
        description=(
            "Derived entries the render left out (the base wins, or adding them would change what the "
            "base allows), each with the reason and what to change; routes left out are never approved "
            "by the operator. At most 64 are listed; the PolicyApplied message counts them all."
        ),
    )


class SkippedPolicyEntry(ApiModel):
    """A derived policy entry the render did not add, and why."""

    kind: Literal["route", "grant"] = Field(description="route (autoApprovers.routes) or grant.")
    entry: str = Field(max_length=1024, description="The route, or the grant as src -> dst ports.")
    reason: str = Field(max_length=2048, description="Why it was left out, and what to change to have it.")
    sources: list[BoundedString] | None = Field(
        default=None, max_length=16, description="The objects it was derived from, e.g. TailnetSite branch."
    )


class TailnetStatus(ApiModel):
    """Observed state of a Tailnet."""

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(
        default=None, description="Ready, Reachable, KeyValid and PolicyApplied conditions."
    )
    api_key: APIKeyStatus | None = Field(default=None, description="The operator's working API key.")
    server_version: str | None = Field(default=None, max_length=64, description="Version Headscale reports.")
    last_contact_time: Timestamp | None = Field(
        default=None, description="When the operator last reached the Headscale API."
    )
    policy: PolicyStatus | None = Field(default=None, description="State of the Headscale policy.")


class Tailnet(ApiModel):
    """A Headscale control server the cluster joins (cluster-scoped)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["Tailnet"] = "Tailnet"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetSpec
    status: TailnetStatus | None = None
